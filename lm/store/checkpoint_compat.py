"""Whether a checkpoint fits this config: the shapes of its arrays against the config's."""

from __future__ import annotations

import jax

from lm.errors import UserError
from lm.model.params import leaf_paths


class IncompatibleCheckpoint(UserError):
    """The checkpoint's arrays do not have the shapes this config gives."""


def shapes(tree) -> dict:
    return {p: [list(x.shape), str(x.dtype)] for p, x in zip(leaf_paths(tree), jax.tree.leaves(tree))}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_compatible(step: int, directory, meta: dict, abstract_state, config: dict | None) -> None:
    """IncompatibleCheckpoint naming the params (and the model keys) whose shapes differ from this config's."""
    now = shapes(abstract_state)
    saved = meta["shapes"]
    diffs = [
        f"{p}: saved {saved[p][0]} {saved[p][1]}, now {now[p][0]} {now[p][1]}"
        for p in now
        if p in saved and saved[p] != now[p]
    ]
    diffs += [f"{p}: missing in the checkpoint" for p in now if p not in saved]
    diffs += [f"{p}: not in this config" for p in saved if p not in now]
    if not diffs:
        return
    diffs = [d for d in diffs if d.startswith("params/")] or diffs  # the optimizer state mirrors them
    keys = ""
    if config is not None and meta.get("config"):
        before, after = _flat(meta["config"].get("model", {})), _flat(config.get("model", {}))
        changed = [
            f"model.{k}={before.get(k)!r} (checkpoint) vs {after.get(k)!r} (now)"
            for k in sorted(before.keys() | after.keys())
            if before.get(k) != after.get(k)
        ]
        keys = f"; config differs in {', '.join(changed)}" if changed else ""
    shown = "; ".join(diffs[:10]) + (f"; ... ({len(diffs)} in all)" if len(diffs) > 10 else "")
    raise IncompatibleCheckpoint(
        f"checkpoint step {step} in '{directory}' does not fit this config: "
        f"{shown}{keys}; use the config it was trained with or a new --workdir"
    )
