"""Preference training of the tiny model (`lm dpo` / `lm reward --config configs/pairs_tiny.py`):
the keys set here change the fine-tuning defaults (lm/config/finetune.py); the model
comes from --init. The sort task's pairs are short, so rows are 40 tokens, not the model's 256."""

from lm.config import ConfigDict


def get_config():
    c = ConfigDict()
    c.data = dict(seq_len=40)
    c.finetune = dict(epochs=0.5)  # (the answer length of --eval-answers is lm dpo's: not lm reward's)
    c.pairs = dict(eval_pairs=256)
    # RPO term: on pairs the SFT model already ranks right, plain DPO lowers the chosen answers too
    c.dpo = dict(loss="sigmoid", beta=0.1, rpo_alpha=1.0)
    c.optim = dict(lr=1e-4, warmup_steps=10)
    c.train = dict(batch_size=32, log_every=10)
    c.eval = dict(every_steps=25, batches=1, batch_size=64)
    c.checkpoint = dict(every_steps=100, keep=2)
    return c
