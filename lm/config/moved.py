"""Config keys that moved to another section. A config file or override that sets one fails in one
line naming the new key (lm.config.core); a saved config (a run's config.json, an export's) written
before the move is read with its values in their new place (`migrate`)."""

from __future__ import annotations

# The sections that held the `finetune` keys before it existed, and which of them each held.
_FINETUNE = ("init", "data", "eval_data", "on_bad_record", "max_skipped_fraction", "eval_examples")
_FORMER = {
    "sft": (*_FINETUNE, "eval_max_new_tokens", "epochs", "truncation", "train_on"),
    "pairs": (*_FINETUNE, "eval_max_new_tokens", "epochs", "truncation", "eval_answers"),
    "rl": (*_FINETUNE, "eval_max_new_tokens", "eval_answers"),
}

# old dotted key (or a section gone whole) -> its new place
MOVED = {f"{old}.{key}": f"finetune.{key}" for old, keys in _FORMER.items() for key in keys} | {"sft": "finetune"}


def moved_message(dotted: str, value=None) -> str | None:
    """The error for a key (or a section's keys, `value` a mapping) that moved; None if none did."""
    inside = [f"{dotted}.{k}" for k in value] if hasattr(value, "keys") else []
    for key in [*inside, dotted]:
        if key in MOVED:
            return f"config key '{key}' moved to '{MOVED[key]}'"
    return None


def migrate(saved: dict) -> dict:
    """A saved config from before the moves, with each moved value in its new place: the values of
    the section that was in use (the one naming an init), else sft's. Newer configs are returned as is."""
    if "finetune" in saved or not any(name in saved for name in _FORMER):
        return saved
    held = {name: dict(saved.get(name) or {}) for name in _FORMER}
    used = next((name for name in _FORMER if held[name].get("init")), "sft")
    out = {k: v for k, v in saved.items() if k != "sft"}
    out["finetune"] = {k: v for k, v in held[used].items() if k in _FORMER[used]}
    for name in ("pairs", "rl"):
        if name in saved:
            out[name] = {k: v for k, v in held[name].items() if k not in _FORMER[name]}
    return out
