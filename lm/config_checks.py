"""Config checks: `require`, and the consistency checks of the post-training sections (sft,
pairs, dpo, reward, rl) that `lm.config.validate` runs after the shared ones."""

from __future__ import annotations

from lm.errors import UserError


def require(ok: bool, key: str, value, expected: str) -> None:
    if not ok:
        raise UserError(f"config key '{key}' = {value!r}: {expected}")


def validate_stages(c) -> None:
    require(c.sft.epochs >= 0, "sft.epochs", c.sft.epochs, "expected >= 0 (0 = use train.steps)")
    require(0.0 <= c.sft.max_skipped_fraction <= 1.0, "sft.max_skipped_fraction", c.sft.max_skipped_fraction,
            "expected a fraction in [0, 1]")
    for section in ("sft", "pairs"):
        for key in ("eval_examples", "eval_max_new_tokens"):
            require(c[section][key] >= 1, f"{section}.{key}", c[section][key], "expected a positive integer")
    require(c.pairs.epochs >= 0, "pairs.epochs", c.pairs.epochs, "expected >= 0 (0 = use train.steps)")
    require(0.0 <= c.pairs.max_skipped_fraction <= 1.0, "pairs.max_skipped_fraction", c.pairs.max_skipped_fraction,
            "expected a fraction in [0, 1]")
    require(c.pairs.eval_pairs >= 1, "pairs.eval_pairs", c.pairs.eval_pairs, "expected a positive integer")
    require(c.dpo.beta > 0, "dpo.beta", c.dpo.beta, "expected > 0")
    require(0.0 <= c.dpo.label_smoothing < 0.5, "dpo.label_smoothing", c.dpo.label_smoothing,
            "expected a fraction in [0, 0.5)")
    require(c.dpo.label_smoothing == 0.0 or c.dpo.loss == "sigmoid", "dpo.label_smoothing",
            c.dpo.label_smoothing, f"applies to dpo.loss='sigmoid' only (dpo.loss is '{c.dpo.loss}')")
    for key in ("rpo_alpha", "simpo_gamma"):
        require(c.dpo[key] >= 0, f"dpo.{key}", c.dpo[key], "expected >= 0")
    require(c.reward.center_coef >= 0, "reward.center_coef", c.reward.center_coef, "expected >= 0")
    _validate_rl(c.rl)


def _validate_rl(r) -> None:
    for key in ("prompts_per_step", "group_size", "max_new_tokens", "epochs", "minibatches", "eval_prompts",
                "eval_examples", "eval_max_new_tokens"):
        require(r[key] >= 1, f"rl.{key}", r[key], "expected a positive integer")
    require((r.prompts_per_step * r.group_size) % r.minibatches == 0, "rl.minibatches", r.minibatches,
            f"must divide the {r.prompts_per_step * r.group_size} rollouts of a step "
            "(rl.prompts_per_step x rl.group_size)")
    require(r.group_size >= 2 or r.algo == "ppo", "rl.group_size", r.group_size,
            "GRPO compares the responses to one prompt: at least 2")
    for key in ("beta", "eps_low", "eps_high", "adv_eps", "vf_coef", "value_clip", "truncation_penalty",
                "temperature"):
        require(r[key] >= 0, f"rl.{key}", r[key], "expected >= 0")
    require(0 < r.top_p <= 1, "rl.top_p", r.top_p, "expected a fraction in (0, 1]")
    require(0 <= r.gamma <= 1 and 0 <= r.lam <= 1, "rl.gamma/rl.lam", (r.gamma, r.lam), "expected values in [0, 1]")
    require(0.0 <= r.max_skipped_fraction <= 1.0, "rl.max_skipped_fraction", r.max_skipped_fraction,
            "expected a fraction in [0, 1]")
