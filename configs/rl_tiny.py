"""RL from rewards on the tiny model (`lm rl --config configs/rl_tiny.py`): GRPO on the sort
task's exact-answer reward (lm.data.synthetic.sort_reward); the keys set here change the
fine-tuning defaults (lm/config/finetune.py); the model comes from --init. The task's
prompts and answers are short, so rows are 40 tokens, 16 of them for the response."""

from lm.config import ConfigDict


def get_config():
    c = ConfigDict()
    c.data = dict(seq_len=40)
    c.rl = dict(
        algo="grpo",
        rewards="lm.data.synthetic:sort_reward",
        prompts_per_step=16,
        group_size=8,
        max_new_tokens=16,
        temperature=1.0,
        beta=0.04,
        epochs=1,
        minibatches=1,
        eval_prompts=256,
    )
    c.finetune = dict(eval_examples=256, eval_max_new_tokens=16)
    c.optim = dict(lr=1e-4, warmup_steps=5)
    c.train = dict(steps=120, log_every=1)
    c.eval = dict(every_steps=20, batch_size=128)
    c.checkpoint = dict(every_steps=50, keep=2)
    return c
