"""FP8 training (model.fp8) against the same run without it: loss curves on CPU.

Three short pretraining runs of a tiny model, identical but for `model.fp8` (off, current
scaling, delayed scaling; same init, same batches, same optimizer), on a synthetic learnable
stream: each token is followed by one of two successors drawn from a fixed random table, so
the loss falls from ln(vocab) towards ln 2. Prints the losses every 10 steps and each fp8 run's
largest gap over all steps; writes a PNG of the curves overlaid (and a JSON of them).
tests/train/test_fp8_training.py runs `curves` at the default shape and asserts the gaps stay
under its tolerance.

    .venv/bin/python bench/fp8.py [--steps 50] [--compute-dtype float32] [--out runs/fp8]

Runs on one CPU device (XLA:CPU converts the fp8 operands to float32 for its dots: the numbers
are the fp8 products', the speed is not). Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

VOCAB, SEQ, BATCH = 64, 32, 8
SHAPE = dict(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=SEQ)


MODES = ("off", "current", "delayed")  # model.fp8 off, or on with that model.fp8_scaling


def config(mode: str, compute_dtype: str = "float32", steps: int = 50, devices: int = 1):
    from lm.config import base_config

    c = base_config()
    c.model.update(**SHAPE, compute_dtype=compute_dtype, fp8=mode != "off")
    if mode != "off":
        c.model.fp8_scaling = mode
    c.data.seq_len = SEQ
    c.train.update(batch_size=BATCH, steps=steps)
    c.optim.update(lr=3e-3, warmup_steps=5)
    if devices == 8:
        c.mesh.update(data=2, fsdp=2, tensor=2)
    return c


def batch(step: int, seed: int = 0) -> dict:
    """A [BATCH, SEQ] batch of the two-successor stream; the table is fixed, the rows vary by step."""
    table = np.random.default_rng(seed).integers(0, VOCAB, (VOCAB, 2))
    rng = np.random.default_rng(1000 + step)
    tokens = np.empty((BATCH, SEQ + 1), np.int32)
    tokens[:, 0] = rng.integers(0, VOCAB, BATCH)
    for t in range(SEQ):
        tokens[:, t + 1] = table[tokens[:, t], rng.integers(0, 2, BATCH)]
    return dict(
        inputs=tokens[:, :-1],
        targets=tokens[:, 1:].copy(),
        loss_mask=np.ones((BATCH, SEQ), np.float32),
        segment_ids=np.ones((BATCH, SEQ), np.int32),
        positions=np.broadcast_to(np.arange(SEQ, dtype=np.int32), (BATCH, SEQ)).copy(),
    )


def run(c, steps: int, devices=None, state=None, start: int = 0):
    """(losses of steps start..steps-1, final state) of config c from `state` (None: a fresh init, seed 0)."""
    import jax

    from lm.train.setup import build_run

    r = build_run(c, devices=devices or jax.devices()[:1])
    state = r.init_state(seed=0) if state is None else state
    signature = r.signature()
    step, placer = r.train_step(signature), r.placer(signature)
    losses = []
    for i in range(start, steps):
        state, m = step(state, placer.from_global(batch(i)))
        losses.append(float(m["loss"]))
    return losses, state


def curves(steps: int = 50, compute_dtype: str = "float32") -> dict:
    """{mode: losses} for each of MODES."""
    return {mode: run(config(mode, compute_dtype, steps), steps)[0] for mode in MODES}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--compute-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--out", default="runs/fp8")
    a = p.parse_args()
    got = curves(a.steps, a.compute_dtype)
    ref = np.array(got["off"])
    print(f"{'step':>5} {a.compute_dtype:>10} {'current':>10} {'delayed':>10}")
    for i in list(range(0, a.steps, 10)) + [a.steps - 1]:
        print(f"{i:>5} {ref[i]:>10.4f} {got['current'][i]:>10.4f} {got['delayed'][i]:>10.4f}")
    gaps = {mode: np.abs(np.array(got[mode]) - ref) for mode in MODES[1:]}
    for mode, gap in gaps.items():
        rel = float((gap / ref).max())
        print(f"fp8 {mode}: max |gap| {gap.max():.4f} at step {int(gap.argmax())}; relative {rel:.2%}")
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8.json").write_text(json.dumps(got | {"dtype": a.compute_dtype}))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ref, label=f"{a.compute_dtype} matmuls")
    for mode, style in zip(MODES[1:], ("--", ":")):
        ax.plot(got[mode], label=f"model.fp8, {mode} scaling (max gap {gaps[mode].max():.4f})", linestyle=style)
    ax.set(xlabel="step", ylabel="training loss", title=f"fp8 (e4m3 / e5m2) vs {a.compute_dtype}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "fp8.png", dpi=120)
    print(f"wrote {out / 'fp8.png'}")


if __name__ == "__main__":
    main()
