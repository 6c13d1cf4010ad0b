"""The `checkpoint` section: when training state is saved and which saves are kept."""

from __future__ import annotations

from lm.config.core import require

# keep the newest `keep` plus every step divisible by keep_period (0 = none); every_minutes
# adds timed saves (0 = off); processes agree on signals and timed saves every agree_every_steps
# local_dir: a fast per-host disk for the local tier (lm.store.local_tier; "" = off), saved every
# local_every_steps, the newest local_keep kept
DEFAULTS = dict(
    every_steps=100,
    every_minutes=0.0,
    keep=3,
    keep_period=0,
    agree_every_steps=5,
    local_dir="",
    local_every_steps=0,
    local_keep=2,
)


def check(c) -> None:
    k = c.checkpoint
    for key in ("every_steps", "keep_period", "local_every_steps"):
        require(k[key] >= 0, f"checkpoint.{key}", k[key], "expected >= 0 (0 = off)")
    require(k.every_minutes >= 0, "checkpoint.every_minutes", k.every_minutes, "expected >= 0 (0 = off)")
    require(k.keep >= 1, "checkpoint.keep", k.keep, "expected a positive integer")
    require(k.local_keep >= 1, "checkpoint.local_keep", k.local_keep, "expected a positive integer")
    require(
        not k.local_dir or k.local_every_steps > 0,
        "checkpoint.local_every_steps",
        k.local_every_steps,
        f"checkpoint.local_dir={k.local_dir!r} needs local saves: expected > 0",
    )
    require(
        k.agree_every_steps >= 1, "checkpoint.agree_every_steps", k.agree_every_steps, "expected a positive integer"
    )
