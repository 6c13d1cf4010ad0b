"""Supervised fine-tuning of the tiny model (`lm sft --config configs/sft_tiny.py`): the keys set
here change the fine-tuning defaults (lm/config/finetune.py); the model comes from --init."""

from lm.config import ConfigDict


def get_config():
    c = ConfigDict()
    c.finetune = dict(epochs=1.0, eval_examples=256, eval_max_new_tokens=16)
    c.optim = dict(lr=1e-3, warmup_steps=20)
    c.train = dict(batch_size=16, log_every=10)
    c.eval = dict(every_steps=50, batches=4, batch_size=16)
    c.checkpoint = dict(every_steps=100, keep=2)
    return c
