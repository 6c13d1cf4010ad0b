"""The `optim` section: the optimizer (AdamW, or Muon for the blocks' matrices with AdamW for the
rest) and the learning-rate schedule (warmup + cosine, or warmup-stable-decay) (lm.train.optim)."""

from __future__ import annotations

from lm.config.core import require

# decay_steps 0: the schedule spans train.steps; z_loss: weight of log(Z)^2 on the logits' normaliser.
# schedule "wsd": warmup, then lr held until the last decay_fraction of the span, then decay_shape
# down to lr * min_lr_ratio. muon_lr: the peak rate of the matrices under optimizer "muon" (the
# same schedule scales it); muon_rms 0: Keller Jordan's sqrt(max(1, fan_out / fan_in)) scaling of
# the orthogonalised update, > 0: that RMS times sqrt(max(fan_in, fan_out)) (Moonlight's 0.2).
DEFAULTS = dict(
    optimizer="adamw",
    lr=3e-3,
    min_lr_ratio=0.1,
    warmup_steps=50,
    decay_steps=0,
    schedule="cosine",
    decay_fraction=0.2,
    decay_shape="linear",
    b1=0.9,
    b2=0.95,
    eps=1e-8,
    weight_decay=0.1,
    decay_embeddings=False,
    decay_norms_and_biases=False,
    grad_clip=1.0,
    muon_lr=0.02,
    muon_momentum=0.95,
    muon_ns_steps=5,
    muon_rms=0.0,
    z_loss=0.0,
)

CHOICES = dict(optimizer=("adamw", "muon"), schedule=("cosine", "wsd"), decay_shape=("linear", "cosine", "1-sqrt"))


def check(c) -> None:
    o = c.optim
    require(o.lr > 0, "optim.lr", o.lr, "expected a positive learning rate")
    require(0 <= o.warmup_steps, "optim.warmup_steps", o.warmup_steps, "expected >= 0")
    require(0 < o.decay_fraction <= 1, "optim.decay_fraction", o.decay_fraction, "expected a fraction in (0, 1]")
    require(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", o.min_lr_ratio, "expected a ratio in [0, 1]")
    require(o.muon_lr > 0, "optim.muon_lr", o.muon_lr, "expected a positive learning rate")
    require(0 <= o.muon_momentum < 1, "optim.muon_momentum", o.muon_momentum, "expected a momentum in [0, 1)")
    require(o.muon_ns_steps >= 1, "optim.muon_ns_steps", o.muon_ns_steps, "expected >= 1 Newton-Schulz steps")
    require(o.muon_rms >= 0, "optim.muon_rms", o.muon_rms, "expected >= 0 (0: width scaling)")
