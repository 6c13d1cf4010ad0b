"""`lm demo`'s parallelism stage: the tiny model's pretraining step on 8 simulated CPU devices, as a
1F1B pipeline over 4 stages, as interleaved 1F1B (2 stages x 2 virtual stages, with fsdp and
tensor), and with the sequence split over 4 context devices (ring attention), each trained a few
steps from the same initial state and batches as one device, which they must equal.

The devices are simulated in a subprocess (`python -m lm.demo.scale`): XLA's device count is
fixed when jax starts, and the demo's own process runs on the host's one CPU device.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

from lm.config import load_config
from lm.config.mesh import AXES

CONFIG = "configs/tiny.py"
STEPS = 3
# name: (mesh, model overrides); the rest of the mesh is 1
VARIANTS = {
    "1F1B, 4 stages x data 2": (
        dict(stage=4, data=2),
        ["model.pipeline_schedule=1f1b", "model.pipeline_microbatches=4"],
    ),
    "interleaved 1F1B, 2 stages x 2 virtual x fsdp 2 x tensor 2": (
        dict(stage=2, fsdp=2, tensor=2),
        ["model.pipeline_schedule=1f1b", "model.pipeline_repeats=2", "model.pipeline_microbatches=4"],
    ),
    "ring attention, context 4 x fsdp 2": (dict(context=4, fsdp=2), ["model.context_attention=ring"]),
}


def parallel_runs(out: pathlib.Path) -> dict:
    """Runs the comparison in a subprocess with 8 simulated devices; its figures ({} if it failed)."""
    out.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "lm.demo.scale", str(out / "scale.json")], env=env)
    if proc.returncode != 0:
        print(f"lm: warning: the parallelism comparison failed (exit {proc.returncode}); see the output above")
        return {}
    return json.loads((out / "scale.json").read_text())


def scale_lines(figures: dict) -> list[str]:
    """The evidence table's lines for this stage."""
    if not figures:
        return []
    lines = [f"parallelism on 8 simulated CPU devices, {figures['steps']} steps from one state, against one device:"]
    for name, f in figures["variants"].items():
        lines.append(
            f"  {name}: loss differs by at most {f['loss_rel']:.1e} (relative); params by at most "
            f"{f['param_rel']:.1e} of how far the steps moved them"
        )
    return lines


def _steps(overrides, mesh: dict, init, batches):
    """(initial state, params after the batches, losses) on `mesh` (host copies)."""
    import jax

    from lm.train.setup import build_run

    c = load_config(CONFIG, [*overrides, *(f"mesh.{a}={mesh.get(a, 1)}" for a in AXES)])
    r = build_run(c, devices=jax.devices()[: math.prod(mesh.values())])
    state = r.init_state(0) if init is None else jax.device_put(init, r.state_shardings)
    first = jax.device_get(state)
    step, place = r.train_step(), r.placer()
    losses = []
    for batch in batches:
        state, metrics = step(state, place(batch))
        losses.append(float(metrics["loss"]))
    return first, jax.device_get(state.params), losses


def main(path: str) -> None:
    import jax
    import numpy as np

    from lm.train.setup import build_run, host_batch

    base = ["train.batch_size=16", "model.remat=full"]
    signature = build_run(load_config(CONFIG, base), devices=jax.devices()[:1]).signature()
    batches = [host_batch(signature, seed, load_config(CONFIG).model.vocab_size) for seed in range(STEPS)]
    init, ref, ref_losses = _steps(base, {}, None, batches)
    moved = [np.abs(r - i).max() for r, i in zip(jax.tree.leaves(ref), jax.tree.leaves(init.params))]
    figures = {"steps": STEPS, "losses": ref_losses, "variants": {}}
    for name, (mesh, overrides) in VARIANTS.items():
        _, got, losses = _steps([*base, *overrides], mesh, init, batches)
        loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        diffs = [
            np.abs(g - r).max() / max(m, 1e-12) for g, r, m in zip(jax.tree.leaves(got), jax.tree.leaves(ref), moved)
        ]
        figures["variants"][name] = {"losses": losses, "loss_rel": float(loss_rel), "param_rel": float(max(diffs))}
        print(
            f"{name}: losses {', '.join(f'{x:.5f}' for x in losses)} (one device: "
            f"{', '.join(f'{x:.5f}' for x in ref_losses)})",
            flush=True,
        )
    pathlib.Path(path).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main(sys.argv[1])
