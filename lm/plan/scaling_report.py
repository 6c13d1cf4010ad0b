"""What `lm scale` reports from a ladder: the fitted law with bootstrap intervals, the compute-optimal
N and D for a budget (6 N D FLOPs) with the predicted loss, scaling.json, the figure, and for `lm plan
--scaling` where a config sits against that optimum. Numpy, scipy and matplotlib: no jax."""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np

from lm.errors import UserError
from lm.plan.scaling_fit import BOUNDS, Law, bootstrap, interval

FIELDS = ("E", "A", "B", "alpha", "beta")


def fit_ladder(rows: list[dict], samples: int = 200, seed: int = 0) -> dict:
    """The law fitted to the ladder's points (N total params, D tokens, held-out loss), its bootstrap
    fits and the 95% percentile intervals of E, alpha and beta."""
    n, d, loss = ([r[k] for r in rows] for k in ("params", "tokens", "loss"))
    law, laws = bootstrap(n, d, loss, samples=samples, seed=seed)
    return {
        "law": {k: getattr(law, k) for k in FIELDS},
        "intervals": {k: interval([getattr(x, k) for x in laws]) for k in ("E", "alpha", "beta")},
        "bootstrap": [[getattr(x, k) for k in FIELDS] for x in laws],
        "n_counts": "total params (lm.model.counts.param_count), as Chinchilla's fits",
        "compute": "6 N D",
        "points": rows,
    }


def laws_of(report: dict) -> tuple[Law, list[Law]]:
    return Law(**report["law"]), [Law(*row) for row in report["bootstrap"]]


def predict(report: dict, n: float, d: float) -> dict:
    """The law's loss at (n, d) and its bootstrap interval."""
    law, laws = laws_of(report)
    return {"loss": float(law.loss(n, d)), "interval": interval([float(x.loss(n, d)) for x in laws])}


def optimum(report: dict, flops: float) -> dict:
    """The compute-optimal N and D for `flops` (6 N D) and the loss there, each with the interval
    of the bootstrap fits' own optima."""
    law, laws = laws_of(report)
    n, d = law.optimum(flops)
    theirs = [x.optimum(flops) for x in laws]
    return {
        "flops": flops,
        "n_opt": n,
        "d_opt": d,
        "n_interval": interval([a for a, _ in theirs]),
        "d_interval": interval([b for _, b in theirs]),
        "loss": float(law.loss(n, d)),
        "loss_interval": interval([float(x.loss(a, b)) for x, (a, b) in zip(laws, theirs)]),
        "tokens_per_param": d / n,
    }


def _span(value: float, lo_hi) -> str:
    return f"{value:.3f} [{lo_hi[0]:.3f}, {lo_hi[1]:.3f}]"


def at_bounds(law: Law) -> list[str]:
    """The parameters the fit left at an end of its search range: the points do not pin them down."""
    (a_lo, a_hi), (b_lo, b_hi), (e_lo, _), (al_lo, al_hi), (be_lo, be_hi) = BOUNDS
    ends = {
        "A": not a_lo + 1e-3 < math.log(law.A) < a_hi - 1e-3,
        "B": not b_lo + 1e-3 < math.log(law.B) < b_hi - 1e-3,
        "E": math.log(law.E) < e_lo + 1e-3,
        "alpha": not al_lo + 1e-3 < law.alpha < al_hi - 1e-3,
        "beta": not be_lo + 1e-3 < law.beta < be_hi - 1e-3,
    }
    return [k for k, hit in ends.items() if hit]


def law_text(report: dict) -> str:
    law, iv = Law(**report["law"]), report["intervals"]
    lines = [
        f"fitted on {len(report['points'])} points (N total params, D tokens; Huber on log loss, L-BFGS-B):",
        f"  {law.text()}",
        f"  E {_span(law.E, iv['E'])}, alpha {_span(law.alpha, iv['alpha'])}, beta {_span(law.beta, iv['beta'])}"
        f"  (95% bootstrap, {len(report['bootstrap'])} resamples)",
    ]
    if at_bounds(law):
        lines.append(
            f"  warning: {', '.join(at_bounds(law))} ended at the edge of the search range: these points do not "
            "pin the law down (more shapes or token budgets, further apart, would)"
        )
    return "\n".join(lines)


def optimum_text(opt: dict) -> str:
    from lm.plan.scale import human

    return "\n".join(
        [
            f"compute-optimal for {opt['flops']:.3e} FLOPs (6 N D):",
            f"  N {human(opt['n_opt'])} [{human(opt['n_interval'][0])}, {human(opt['n_interval'][1])}] params, "
            f"D {human(opt['d_opt'])} [{human(opt['d_interval'][0])}, {human(opt['d_interval'][1])}] tokens, "
            f"{opt['tokens_per_param']:.1f} tokens per param",
            f"  predicted held-out loss {_span(opt['loss'], opt['loss_interval'])}",
        ]
    )


def write_report(workdir, report: dict) -> pathlib.Path:
    from lm.train.workdir import write_atomic

    path = pathlib.Path(workdir) / "scaling.json"
    write_atomic(path, json.dumps(report, indent=2))
    return path


def read_report(path) -> dict:
    """scaling.json as `lm scale` wrote it, or one UserError line."""
    try:
        report = json.loads(pathlib.Path(path).read_text())
        Law(**report["law"])
        [Law(*row) for row in report["bootstrap"]]
        return report
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--scaling {path}: expected the scaling.json that `lm scale` writes ({e})") from None


def plot(report: dict, path) -> None:
    """Held-out loss against compute: each shape's points and its fitted curve, the compute-optimal
    frontier, the budget's optimum (with its interval) and the --verify run if any."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    law = Law(**report["law"])
    rows, opt, verify = report["points"], report.get("optimum"), report.get("verify")
    flops = [r["flops"] for r in rows] + ([opt["flops"]] if opt else [])
    grid = np.geomspace(min(flops) / 2, max(flops) * 2, 200)
    fig, ax = plt.subplots(figsize=(8, 5))
    shapes = sorted({(r["width"], r["depth"], r["params"]) for r in rows})
    for i, (w, depth, n) in enumerate(shapes):
        color = f"C{i % 10}"
        mine = sorted((r["flops"], r["loss"]) for r in rows if (r["width"], r["depth"]) == (w, depth))
        ax.plot(*zip(*mine), "o", color=color, label=f"w{w} l{depth} ({n / 1e6:.2f}M params)")
        ax.plot(grid, law.loss(n, grid / (6 * n)), "-", color=color, lw=1, alpha=0.7)
    frontier = [law.loss(*law.optimum(c)) for c in grid]
    ax.plot(grid, frontier, "k--", lw=1.2, label="compute-optimal (fit)")
    if opt:
        lo, hi = opt["loss_interval"]
        label = f"optimum at budget: N {opt['n_opt'] / 1e6:.2f}M, D {opt['d_opt'] / 1e6:.2f}M"
        # a bootstrap percentile interval need not hold the point estimate (the fit at a bound)
        yerr = [[max(0.0, opt["loss"] - lo)], [max(0.0, hi - opt["loss"])]]
        ax.errorbar([opt["flops"]], [opt["loss"]], yerr=yerr, fmt="*", color="k", ms=12, label=label)
    if verify and verify.get("measured") is not None:
        ax.plot([verify["flops"]], [verify["measured"]], "rX", ms=10, label=f"--verify measured ({verify['name']})")
    ax.set_xscale("log")
    shown = [r["loss"] for r in rows] + (list(opt["loss_interval"]) if opt else [])
    shown += [verify["measured"]] if verify and verify.get("measured") is not None else []
    ax.set_ylim(min(shown) - 0.1 * (max(shown) - min(shown)), max(shown) + 0.25 * (max(shown) - min(shown)))
    ax.set_xlabel("compute (6 N D FLOPs)")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title(Law(**report["law"]).text(), fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def against(config, report: dict) -> str:
    """Where `config` sits against the fitted optimum for its own compute (`lm plan --scaling`)."""
    from lm.model.counts import param_count
    from lm.plan.scale import human

    n = param_count(config.model)
    d = config.train.steps * config.train.batch_size * config.data.seq_len
    opt = optimum(report, 6.0 * n * d)
    here = predict(report, n, d)
    return "\n".join(
        [
            f"against the scaling fit ({Law(**report['law']).text()}):",
            f"  this config: N {human(n)}, D {human(d)} ({d / n:.1f} tokens/param), {6.0 * n * d:.3e} FLOPs (6 N D); "
            f"predicted loss {_span(here['loss'], here['interval'])}",
            f"  optimum for that compute: N {human(opt['n_opt'])}, D {human(opt['d_opt'])} "
            f"({opt['tokens_per_param']:.1f} tokens/param); predicted loss {_span(opt['loss'], opt['loss_interval'])}",
            f"  N / N_opt = {n / opt['n_opt']:.2f} ({'larger' if n > opt['n_opt'] else 'smaller'} than optimal; "
            f"the fit's points span N {human(min(r['params'] for r in report['points']))} to "
            f"{human(max(r['params'] for r in report['points']))}{_outside(report, n)})",
        ]
    )


def _outside(report: dict, n: float) -> str:
    ns = [r["params"] for r in report["points"]]
    if min(ns) <= n <= max(ns):
        return ""
    return f"; this N is {math.log10(max(n / max(ns), min(ns) / n)):.1f} decades outside them: an extrapolation"
