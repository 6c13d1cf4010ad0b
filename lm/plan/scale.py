"""The scaling ladder of `lm scale`: a family of shapes derived from one pretraining config, each
trained for a few token budgets as a normal `lm train` run in WORKDIR/points/NAME.

The family rule (`shape`): a width w must be a multiple of the config's head_dim, which every
shape keeps; n_heads = w / head_dim; n_kv_heads keeps the config's query heads per kv head (the
largest divisor of n_heads not above n_heads / group); d_ff (and an MoE's expert_d_ff and
shared_d_ff) keep their ratio to d_model, rounded to a multiple of 8. A token budget becomes
train.steps = round(tokens / (train.batch_size x data.seq_len)), at least 1; the point's D is
steps x batch_size x seq_len. Each point also caps optim.warmup_steps at a tenth of its steps,
evaluates the held-out set at its end only (eval.every_steps=0) and writes no closing sample; the
config's schedule spans the point's own steps (optim.decay_steps=0: a cosine, or warmup-stable-decay's
decay, ends with the point), as Chinchilla's runs do.

N is the total parameter count (lm.model.counts.param_count), as Chinchilla's fits count it;
compute is 6 N D.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
import shlex
import time

from lm.config import with_values
from lm.errors import UserError
from lm.model import counts

_SUFFIX = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
LADDER = "ladder.jsonl"


@dataclasses.dataclass(frozen=True)
class Point:
    name: str
    width: int
    depth: int
    steps: int
    model: dict  # the model keys this shape sets

    def keys(self, config) -> dict:
        """The dotted config keys that make `config` this point's run."""
        return {
            **{f"model.{k}": v for k, v in self.model.items()},
            "train.steps": self.steps,
            "optim.decay_steps": 0,  # the schedule ends with the point, whatever the config's span
            "optim.warmup_steps": min(config.optim.warmup_steps, self.steps // 10),
            "eval.every_steps": 0,
            "train.sample_tokens": 0,
        }


def parse_count(text: str, flag: str) -> int:
    """'0.5M' -> 500000 (K, M, B or G, T; a plain number is itself)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([KMBGT]?)\s*", text, re.I)
    value = float(m.group(1)) * _SUFFIX[m.group(2).upper()] if m else 0
    if value < 1:
        raise UserError(f"{flag} {text!r}: expected a positive count such as 500K, 1M or 2e6")
    return int(round(value))


def parse_list(text: str, flag: str, parse=None) -> list[int]:
    items = [t for t in (s.strip() for s in text.split(",")) if t]
    if not items:
        raise UserError(f"{flag} {text!r}: expected a comma-separated list")
    if parse is not None:
        return [parse(t, flag) for t in items]
    if not all(t.isdigit() and int(t) > 0 for t in items):
        raise UserError(f"{flag} {text!r}: expected positive integers separated by commas, e.g. 64,96,128")
    return [int(t) for t in items]


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'64x2,128x4' -> [(64, 2), (128, 4)]: width x depth."""
    out = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        m = re.fullmatch(r"(\d+)x(\d+)", item)
        if not m or not int(m.group(1)) or not int(m.group(2)):
            raise UserError(f"--shapes {text!r}: expected WIDTHxDEPTH items separated by commas, e.g. 64x2,128x4")
        out.append((int(m.group(1)), int(m.group(2))))
    if not out:
        raise UserError(f"--shapes {text!r}: expected WIDTHxDEPTH items separated by commas, e.g. 64x2,128x4")
    return out


def human(x: float) -> str:
    """A token or param count in short form: 500K, 1M, 2.5M."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.0f}"


def _round8(x: float) -> int:
    return max(8, int(round(x / 8)) * 8)


def shape(m, width: int, depth: int) -> dict:
    """The model keys of the family member of width `width` and depth `depth` (the module's rule)."""
    hd = counts.head_dim(m)
    if width % hd:
        raise UserError(
            f"width {width} (--widths, --shapes): expected a multiple of the config's head_dim {hd} "
            "(every shape keeps it)"
        )
    heads = width // hd
    group = max(1, m.n_heads // m.n_kv_heads)
    kv = max(k for k in range(1, heads + 1) if heads % k == 0 and k * group <= max(heads, group))
    keys = dict(d_model=width, n_layers=depth, n_heads=heads, n_kv_heads=kv, d_ff=_round8(m.d_ff * width / m.d_model))
    for key in ("expert_d_ff", "shared_d_ff"):
        if getattr(m, key, 0):
            keys[key] = _round8(getattr(m, key) * width / m.d_model)
    return keys


def tokens_per_step(config) -> int:
    return config.train.batch_size * config.data.seq_len


def make_point(config, width: int, depth: int, tokens: int, prefix: str = "") -> Point:
    steps = max(1, round(tokens / tokens_per_step(config)))
    name = f"{prefix}w{width}-l{depth}-{human(tokens)}"
    return Point(name, width, depth, steps, shape(config.model, width, depth))


def ladder_points(config, shapes: list[tuple[int, int]], tokens: list[int]) -> list[Point]:
    points, seen = [], {}
    for w, d in shapes:
        for t in tokens:
            p = make_point(config, w, d, t)
            key = (w, d, p.steps)
            if p.name in seen or key in seen.values():
                raise UserError(
                    f"--tokens {','.join(map(str, tokens))}: two budgets round to the same number of steps "
                    f"or name ({p.name}; a step is {tokens_per_step(config)} tokens); use budgets further apart"
                )
            seen[p.name] = key
            points.append(p)
    return points


def point_config(config, point: Point):
    return with_values(config, point.keys(config))


def describe(config, point: Point) -> dict:
    """The ladder's record of a point before it is trained: its shape, N, D and compute."""
    c = point_config(config, point)
    n, d = counts.param_count(c.model), point.steps * tokens_per_step(c)
    return {
        "name": point.name,
        "width": point.width,
        "depth": point.depth,
        "params": n,
        "non_embedding_params": counts.non_embedding_params(c.model),
        "tokens": d,
        "steps": point.steps,
        "flops": 6.0 * n * d,
        "model_flops": counts.flops_per_token(c.model, c.data.seq_len) * d,
    }


def train_command(config_path: str, overrides: list[str], config, point: Point, workdir) -> str:
    """The `lm train` command that trains `point` on its own (a pod launches one job per point): the
    ladder's overrides (as `lm.cli` split them off), then the point's keys."""
    keys = [f"--config.{k}" for k in overrides] + [f"--config.{k}={v}" for k, v in point.keys(config).items()]
    where = pathlib.Path(workdir) / "points" / point.name
    return shlex.join(["lm", "train", "--config", config_path, "--workdir", str(where), *keys])


def finished(workdir: pathlib.Path, config, point: Point) -> dict | None:
    """The summary of a point whose run finished (summary.json at its final step), else None; a
    finished run trained with another model or step count stops the ladder."""
    try:
        summary = json.loads((workdir / "summary.json").read_text())
        saved = json.loads((workdir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    want = json.loads(point_config(config, point).to_json())
    if saved.get("model") != want["model"] or summary.get("step") != point.steps:
        raise UserError(
            f"{workdir} holds a finished run of another config (model or train.steps differ from "
            f"point {point.name}'s); use a new --workdir or move it aside"
        )
    return summary


def run_point(config, point: Point, workdir: pathlib.Path, show_progress: bool) -> dict:
    """Trains one point through the pretraining stage (resuming an interrupted run); returns its
    summary, or the one it finished with before (nothing retrained)."""
    done = finished(workdir, config, point)
    if done is not None:
        return done | {"reused": True}
    from lm.store.checkpoint_read import saved_steps
    from lm.train.pretrain import train
    from lm.verb import Stopped

    resume = bool(saved_steps(workdir / "checkpoints"))
    summary = train(point_config(config, point), workdir, resume=resume, show_progress=show_progress)
    if summary.get("stopped_by"):
        raise Stopped(summary["stopped_by"], summary.get("step"), during=f"point {point.name}")
    return summary


def run_ladder(config, points: list[Point], workdir, show_progress: bool = True, prefix: str = "") -> list[dict]:
    """Trains (or reads back) every point in order, one line per point; writes WORKDIR/ladder.jsonl."""
    workdir = pathlib.Path(workdir)
    rows = []
    for i, point in enumerate(points, 1):
        row = describe(config, point)
        head = f"[{prefix}{i}/{len(points)}] {point.name}: N {human(row['params'])}, D {human(row['tokens'])}"
        print(f"{head}, {point.steps} steps, {row['flops']:.2e} FLOPs", flush=True)
        t0 = time.time()
        summary = run_point(config, point, workdir / "points" / point.name, show_progress)
        row |= {
            "loss": summary.get("eval_loss"),
            "seconds": round(time.time() - t0, 1),  # this invocation's wall time (about 0 when read back)
            "train_seconds": summary.get("run_train_seconds"),  # the run's own training loop, kept by its summary
        }
        if not isinstance(row["loss"], (int, float)) or not math.isfinite(row["loss"]):
            raise UserError(f"point {point.name} ended without a finite held-out loss ({row['loss']}); see its workdir")
        state = "read back (finished before)" if summary.get("reused") else f"trained in {row['seconds']:.0f} s"
        print(f"{head}: held-out loss {row['loss']:.4f}, {state}", flush=True)
        rows.append(row)
    return rows


def write_ladder(workdir, rows: list[dict]) -> None:
    from lm.train.workdir import write_atomic

    write_atomic(pathlib.Path(workdir) / LADDER, "".join(json.dumps(r) + "\n" for r in rows))


def nearest_shape(config, n_target: float, depths: list[int], max_width: int) -> tuple[int, int]:
    """(width, depth) of the family member whose N is nearest n_target in log terms."""
    hd = counts.head_dim(config.model)
    best = None
    for depth in depths:
        for width in range(hd, max_width + hd, hd):
            n = counts.param_count(point_config(config, make_point(config, width, depth, 1)).model)
            gap = abs(math.log(n / n_target))
            if best is None or gap < best[0]:
                best = (gap, width, depth)
    return best[1], best[2]
