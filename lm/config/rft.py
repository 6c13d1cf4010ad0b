"""The `rft` section (`lm rft`): rejection-sampling fine-tuning's sampling and selection."""

from __future__ import annotations

from lm.config.core import require

# samples responses per prompt of finetune.data (prompts as `lm rl` reads them; `prompts` > 0: the
# first that many), max_new_tokens each at temperature / top_p, batch_prompts prompts per engine
# call; each prompt keeps its best response when its reward (lm rl's: rl.rewards, rl.reward_model,
# rl.reward_url) is above threshold, and the kept conversations are fine-tuned on as `lm sft` does
DEFAULTS = dict(
    samples=8,
    threshold=0.0,
    max_new_tokens=64,
    temperature=1.0,
    top_p=1.0,
    prompts=0,
    batch_prompts=64,
)


def check(c) -> None:
    s = c.rft
    for key in ("samples", "max_new_tokens", "batch_prompts"):
        require(s[key] >= 1, f"rft.{key}", s[key], "expected a positive integer")
    require(s.prompts >= 0, "rft.prompts", s.prompts, "expected an integer >= 0 (0: every prompt)")
    require(s.temperature > 0, "rft.temperature", s.temperature, "expected > 0: the responses are sampled")
    require(0 < s.top_p <= 1, "rft.top_p", s.top_p, "expected a fraction in (0, 1]")
