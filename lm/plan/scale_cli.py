"""`lm scale`: a scaling-law ladder. Shapes derived from a pretraining config (lm.plan.scale's family
rule) are trained for a few token budgets, each as a normal `lm train` run in WORKDIR/points/NAME;
L(N, D) = E + A/N^alpha + B/D^beta is fitted to their held-out losses (lm.plan.scaling_fit) and the
compute-optimal N and D of a budget printed. Re-running reads finished points back and resumes an
interrupted one. --verify trains the family member nearest the predicted optimum at its D."""

from __future__ import annotations

import sys

from lm.verb import with_overrides


def add_parser(sub) -> None:
    p = with_overrides(sub, "scale", help="a scaling-law ladder: train small shapes, fit L(N, D), predict the optimum")
    p.add_argument("--config", default="configs/tiny.py", help="the pretraining config the shapes derive from")
    p.add_argument("--workdir", required=True, help="the ladder's directory: points/NAME runs, ladder.jsonl, scaling.*")
    p.add_argument("--widths", default="32,64,96", help="d_model of each shape (multiples of the config's head_dim)")
    p.add_argument("--depths", default="2", help="n_layers of each shape (every width at every depth)")
    p.add_argument("--shapes", default="", help="WIDTHxDEPTH list instead of --widths x --depths, e.g. 64x2,128x4")
    p.add_argument("--tokens", default="500K,2M,8M", help="token budgets every shape trains for (K, M, B suffixes)")
    p.add_argument(
        "--budget",
        default="",
        help="FLOPs (6 N D) to find the compute-optimal N and D for; default: 4x the largest point's",
    )
    p.add_argument("--verify", action="store_true", help="train the shape nearest the optimum at its D and compare")
    p.add_argument(
        "--print-commands", action="store_true", help="print one `lm train` command per point instead of training"
    )
    p.add_argument("--bootstrap", type=int, default=200, help="resamples for the 95%% intervals (default: 200)")
    p.add_argument("--resume", action="store_true", help="accepted for symmetry: a ladder always resumes its points")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (one line per point)")


def _points(args, config):
    from lm.errors import UserError
    from lm.plan.scale import ladder_points, parse_count, parse_list, parse_shapes
    from lm.plan.scaling_fit import MIN_POINTS

    if config.train.init:
        raise UserError(
            f"--config {args.config}: train.init={config.train.init!r}; a ladder trains every shape from scratch"
        )
    if args.shapes:
        shapes = parse_shapes(args.shapes)
    else:
        widths, depths = parse_list(args.widths, "--widths"), parse_list(args.depths, "--depths")
        shapes = [(w, d) for d in depths for w in widths]
    tokens = parse_list(args.tokens, "--tokens", parse_count)
    if args.bootstrap < 10:
        raise UserError(f"--bootstrap {args.bootstrap}: expected at least 10 resamples")
    points = ladder_points(config, shapes, tokens)
    if len(points) < MIN_POINTS and not args.print_commands:
        raise UserError(
            f"{len(points)} point(s) (--widths x --depths x --tokens, or --shapes); the fit of L(N, D) "
            f"needs at least {MIN_POINTS}"
        )
    return points


def _budget(text: str, rows: list[dict]) -> float:
    from lm.errors import UserError

    if not text:
        return 4.0 * max(r["flops"] for r in rows)
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise UserError(f"--budget {text!r}: expected FLOPs as a positive number, e.g. 1e15")
    return value


def run(args, overrides) -> int:
    from lm.config import load_config
    from lm.plan.scale import train_command

    config = load_config(args.config, overrides)
    points = _points(args, config)
    if args.budget:
        _budget(args.budget, [{"flops": 1.0}])  # a bad --budget fails before any training
    if args.print_commands:
        for point in points:
            print(train_command(args.config, overrides, config, point, args.workdir))
        return 0
    from lm.process.cpu_flags import apply_cpu_defaults

    apply_cpu_defaults(config.model.compute_dtype)  # before anything imports jax
    return _ladder(args, config, points)


def _ladder(args, config, points) -> int:
    import pathlib

    from lm.plan import scaling_report as sr
    from lm.plan.scale import run_ladder, write_ladder

    workdir = pathlib.Path(args.workdir)
    rows = run_ladder(config, points, workdir, show_progress=not args.no_progress)
    write_ladder(workdir, rows)
    print(f"fitting L(N, D) to {len(rows)} points, {args.bootstrap} bootstrap resamples ...", flush=True)
    report = sr.fit_ladder(rows, samples=args.bootstrap)
    report["optimum"] = opt = sr.optimum(report, _budget(args.budget, rows))
    print(sr.law_text(report))
    print(sr.optimum_text(opt), flush=True)
    if args.verify:
        report["verify"] = _verify(args, config, points, report, workdir)
    sr.write_report(workdir, report)
    sr.plot(report, workdir / "scaling.png")
    print(f"points: {workdir / 'ladder.jsonl'}; fit: {workdir / 'scaling.json'}; figure: {workdir / 'scaling.png'}")
    sys.stdout.flush()
    return 0


def _verify(args, config, points, report: dict, workdir) -> dict:
    """Trains the family member nearest N_opt for D_opt tokens; the law's prediction for that very
    (N, D) beside the measured held-out loss."""
    from lm.plan import scaling_report as sr
    from lm.plan.scale import make_point, nearest_shape, run_ladder

    opt = report["optimum"]
    depths = sorted({p.depth for p in points})
    width, depth = nearest_shape(config, opt["n_opt"], depths, max_width=4 * max(p.width for p in points))
    point = make_point(config, width, depth, round(opt["d_opt"]), prefix="verify-")
    [row] = run_ladder(config, [point], workdir, show_progress=not args.no_progress, prefix="verify ")
    pred = sr.predict(report, row["params"], row["tokens"])
    gap = row["loss"] - pred["loss"]
    inside = pred["interval"][0] <= row["loss"] <= pred["interval"][1]
    print(
        f"--verify {row['name']}: predicted {pred['loss']:.4f} [{pred['interval'][0]:.4f}, {pred['interval'][1]:.4f}], "
        f"measured {row['loss']:.4f} ({gap:+.4f}, {gap / pred['loss']:+.1%}; "
        f"{'inside' if inside else 'outside'} the interval)"
    )
    return row | {"predicted": pred["loss"], "interval": pred["interval"], "measured": row["loss"]}
