"""The `optim` section: AdamW with warmup and cosine decay (lm.train.optim)."""

from __future__ import annotations

from lm.config.core import require

# decay_steps 0: decay over train.steps; z_loss: weight of log(Z)^2 on the logits' normaliser
DEFAULTS = dict(
    lr=3e-3,
    min_lr_ratio=0.1,
    warmup_steps=50,
    decay_steps=0,
    b1=0.9,
    b2=0.95,
    eps=1e-8,
    weight_decay=0.1,
    decay_embeddings=False,
    decay_norms_and_biases=False,
    grad_clip=1.0,
    z_loss=0.0,
)


def check(c) -> None:
    o = c.optim
    require(o.lr > 0, "optim.lr", o.lr, "expected a positive learning rate")
    require(0 <= o.warmup_steps, "optim.warmup_steps", o.warmup_steps, "expected >= 0")
