"""Tool-use RL on the tiny model (`lm rl --config configs/agent_tiny.py`): GRPO through the demo's
calculator environment (lm.demo.agent.ArithmeticTool) on multi-digit multiplication
(lm.data.arithmetic), rewarded for the exact product; the keys set here change the fine-tuning
defaults (lm/config/finetune.py); the model comes from --init. An episode (the tool listed in
the system turn, the call, its result, the answer) takes ~210 of the model's 256 positions."""

from lm.config import ConfigDict


def get_config():
    c = ConfigDict()
    c.data = dict(seq_len=256)
    c.rl = dict(
        algo="grpo",
        environment="lm.demo.agent:ArithmeticTool",
        max_turns=3,
        prompts_per_step=8,
        group_size=8,
        max_new_tokens=48,
        temperature=1.0,
        beta=0.04,
        eval_prompts=64,
    )
    c.optim = dict(lr=2e-4, warmup_steps=3)
    c.train = dict(steps=20, log_every=1)
    c.eval = dict(every_steps=10, batch_size=128)
    c.checkpoint = dict(every_steps=50, keep=1)
    return c
