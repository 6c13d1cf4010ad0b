"""Curation throughput (input MB/s) on the standard library, each stage on and off.

Runs `lm.data.curate.curate` over the first --max-mb of the interpreter's standard library
(files in sorted order, linked into a temporary directory) with: every stage on (the published
defaults), every stage off (read and write only), and each stage alone off and alone on.
MB/s is input bytes over wall time of the whole call, executor start-up included.

    PYTHONPATH=. python bench/curate_throughput.py [--max-mb 2] [--workers 1] [--out figures.json]

Prints figures only; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import tempfile
import time
from pathlib import Path

STAGES = ("language", "gopher_repetition", "gopher_quality", "c4", "fineweb", "exact_dedup", "near_dedup", "pii")


def capped_stdlib(dest: Path, max_bytes: int) -> int:
    """Links stdlib files into `dest` until max_bytes; returns the bytes linked."""
    from lm.data.corpus import stdlib_files

    total = 0
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in stdlib_files():
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        (dest / path.relative_to(root).as_posix().replace("/", "__")).symlink_to(path)
        total += size
    return total


def runs() -> list[tuple[str, dict[str, bool]]]:
    on = {s: True for s in STAGES}
    out = [("all on", on), ("all off", {s: False for s in STAGES})]
    out += [(f"all but {s}", {**on, s: False}) for s in STAGES]
    out += [(f"only {s}", {t: t == s for t in STAGES}) for s in STAGES]
    return out


def measure(inputs: Path, work: Path, enabled: dict[str, bool], workers: int) -> dict:
    from lm.config import load_config
    from lm.data.curate import curate

    cfg = load_config(None, ["curate.on_bad_record=skip"]).curate
    for stage, on in enabled.items():
        cfg[stage].enabled = on
    start = time.perf_counter()
    report = curate([str(inputs)], work, cfg, workers=workers, progress=False, show_report=False)
    seconds = time.perf_counter() - start
    return {
        "seconds": round(seconds, 2),
        "mb_per_s": round(report["in"]["bytes"] / 1e6 / seconds, 3),
        "kept_bytes_frac": round(report["kept"]["bytes"] / max(1, report["in"]["bytes"]), 3),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-mb", type=float, default=2.0, help="cap on standard-library input")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--out", help="also write the figures as JSON here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        inputs = Path(tmp) / "in"
        inputs.mkdir()
        total = capped_stdlib(inputs, int(args.max_mb * 1e6))
        print(f"input: {total / 1e6:.2f} MB of the standard library, workers={args.workers}")
        print(f"{'run':<26} {'seconds':>8} {'MB/s':>7} {'kept bytes':>10}")
        figures = {}
        for i, (name, enabled) in enumerate(runs()):
            fig = measure(inputs, Path(tmp) / f"out{i}", enabled, args.workers)
            figures[name] = fig
            print(
                f"{name:<26} {fig['seconds']:>8.2f} {fig['mb_per_s']:>7.3f} {fig['kept_bytes_frac']:>10.1%}", flush=True
            )
    if args.out:
        Path(args.out).write_text(
            json.dumps({"input_mb": total / 1e6, "workers": args.workers, "figures": figures}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
