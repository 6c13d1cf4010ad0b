"""Token efficiency: held-out bits per byte against training tokens, `lm` against stock nanoGPT.

Both train on the same bytes (the running interpreter's standard library .py files, split into
train and held-out by a hash of each file's path, as `lm` splits a corpus) and are scored on the
same held-out bytes at the same token counts. nanoGPT runs unmodified from a copy of its checkout
made under the work directory: its own train.py and config/train_shakespeare_char.py (the
"baby GPT" recipe), with command-line overrides only for the data set, device, compile, horizon,
eval interval/iterations and (shape M) the model shape. `lm` runs `lm train` on configs/tiny.py's
recipe with the same shape, byte vocabulary, tokens per step and horizon.

    PYTHONPATH=. .venv/bin/python bench/token_efficiency.py --shapes S --iters 2000 \
        --peer-python /tmp/torch-venv/bin/python --nanogpt /tmp/nanoGPT [--lm-override optim.lr=1e-3]

Prints both curves, the fraction of nanoGPT's tokens at which `lm` first reaches nanoGPT's final
held-out loss, and writes WORKDIR/token_efficiency_<shape>.png and WORKDIR/token_efficiency.json.
Each finished run is kept in WORKDIR/<shape>/<run>.json and reused by a rerun with the same settings.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import pathlib
import pickle
import re
import shutil
import subprocess
import sys
import sysconfig
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lm.data.corpus import resolve_corpus, split_files, stdlib_files  # noqa: E402

# nanoGPT's baby recipe shape (S) and a larger one that still trains on a 2-core CPU (M).
SHAPES = {
    "S": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=64),
    "M": dict(n_layer=8, n_head=8, n_embd=512, block_size=256, batch_size=64),
    "quick": dict(n_layer=2, n_head=2, n_embd=64, block_size=64, batch_size=8),
}
DATASET = "stdlib_bytes"
EVAL_SET = "heldout"
BPB_KEY = f"eval/{EVAL_SET}/bits_per_byte"
MUON = ("optim.optimizer=muon", "optim.schedule=wsd")
LN2 = math.log(2)
_STEP_RE = re.compile(r"^step (\d+): train loss ([0-9.naninf]+), val loss ([0-9.naninf]+)", re.M)
_ITER_RE = re.compile(r"^iter (\d+): loss [0-9.]+, time ([0-9.]+)ms", re.M)


# ---- pure functions (tested) ----


def parse_nanogpt_evals(text: str) -> list[tuple[int, float, float]]:
    """nanoGPT's `step N: train loss X, val loss Y` lines -> [(N, X, Y)] in order."""
    return [(int(n), float(tr), float(va)) for n, tr, va in _STEP_RE.findall(text)]


def parse_nanogpt_iter_ms(text: str, skip: set[int] = frozenset()) -> list[float]:
    """nanoGPT's `iter N: loss X, time Tms` lines -> the times of iterations not in `skip`."""
    return [float(ms) for n, ms in _ITER_RE.findall(text) if int(n) not in skip]


def first_reach(curve: list[tuple[float, float]], target: float) -> float | None:
    """Tokens at which a (tokens, loss) curve first reaches `target` (loss <= target), linear in
    both between the two eval points that straddle it; None if it never does."""
    prev = None
    for tokens, loss in curve:
        if loss <= target:
            if prev is None:
                return float(tokens)
            t0, l0 = prev
            return t0 + (l0 - target) / (l0 - loss) * (tokens - t0)
        prev = (tokens, loss)
    return None


def fraction_of_peer(ours: list[tuple[float, float]], peer: list[tuple[float, float]]) -> dict:
    """When `ours` first reaches the peer's final loss, as a fraction of the peer's final tokens."""
    peer_tokens, target = peer[-1]
    tokens = first_reach(ours, target)
    return {
        "target_bpb": target,
        "tokens": tokens,
        "fraction": None if tokens is None else tokens / peer_tokens,
        "peer_tokens": peer_tokens,
    }


def eval_iters_for(eval_bytes: int, shape: dict) -> int:
    """nanoGPT eval batches that sample about as many bytes as `lm` scores."""
    return max(1, math.ceil(eval_bytes / (shape["batch_size"] * shape["block_size"])))


def swiglu_d_ff(d: int) -> int:
    """SwiGLU width with a 4x GELU MLP's parameter count (3·d·f = 8·d²), to a multiple of 64."""
    return max(64, round(8 * d / 3 / 64) * 64)


# ---- data: the same bytes for both sides ----


def _rank(path: str) -> str:
    return hashlib.sha256(f"eval:{path}".encode()).hexdigest()


def write_corpus(workdir: pathlib.Path, heldout_fraction: float, eval_bytes: int, max_bytes: int) -> dict:
    """WORKDIR/corpus (the stdlib .py files, or the first max_bytes of them by hash), its split as
    `lm` computes it, the peer's train.bin (train files, concatenated), the eval set (whole held-out
    files, valid UTF-8, in hash order up to eval_bytes) as JSONL for `lm` and as the peer's val.bin."""
    root, files = pathlib.Path(sysconfig.get_paths()["stdlib"]), stdlib_files()
    rel = {p: p.relative_to(root).as_posix() for p in files}
    if max_bytes:
        picked, total = [], 0
        for p in sorted(files, key=lambda p: _rank(rel[p])):
            if total >= max_bytes:
                break
            picked.append(p)
            total += p.stat().st_size
        files = sorted(picked, key=lambda p: rel[p])
    corpus = workdir / (f"corpus-{max_bytes}" if max_bytes else "corpus")
    if not corpus.is_dir():
        for p in files:
            (corpus / rel[p]).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p, corpus / rel[p])
    _, local = resolve_corpus(str(corpus))  # the files `lm train` will see, in its order
    train, heldout = split_files(corpus, local, heldout_fraction)
    docs, n = [], 0
    for p in sorted(heldout, key=lambda p: _rank(p.relative_to(corpus).as_posix())):
        try:
            text = p.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue  # lm's eval sets read text; keep their bytes exactly the peer's
        if text and n < eval_bytes:
            docs.append(text)
            n += len(text.encode("utf-8"))
    train_bytes = b"".join(p.read_bytes() for p in train)
    val_bytes = b"".join(t.encode("utf-8") for t in docs)
    eval_set = workdir / "heldout_eval.jsonl"
    eval_set.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    return {
        "corpus": str(corpus),
        "files": len(local),
        "train_files": len(train),
        "heldout_files": len(heldout),
        "eval_files": len(docs),
        "train_bytes": len(train_bytes),
        "heldout_bytes": sum(p.stat().st_size for p in heldout),
        "eval_bytes": len(val_bytes),
        "eval_set": str(eval_set),
        "_train": train_bytes,
        "_val": val_bytes,
    }


def nanogpt_copy(src: pathlib.Path, workdir: pathlib.Path, data: dict) -> pathlib.Path:
    """A copy of the checkout (its code and configs as they are) with our data set added."""
    dst = workdir / "nanoGPT"
    if not dst.is_dir():
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".git", "data", "out*", "assets"))
    ds = dst / "data" / DATASET
    ds.mkdir(parents=True, exist_ok=True)
    import numpy as np  # the peer reads uint16 token files

    np.frombuffer(data["_train"], np.uint8).astype(np.uint16).tofile(ds / "train.bin")
    np.frombuffer(data["_val"], np.uint8).astype(np.uint16).tofile(ds / "val.bin")
    with open(ds / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 256}, f)
    return dst


# ---- the two sides ----


def run_nanogpt(args, shape: dict, name: str, copy: pathlib.Path, out: pathlib.Path) -> dict:
    overrides = [
        f"--dataset={DATASET}",
        "--device=cpu",
        "--compile=False",
        f"--max_iters={args.iters}",
        f"--lr_decay_iters={args.iters}",
        f"--eval_interval={args.eval_every}",
        f"--eval_iters={args.eval_iters}",
    ]
    if name != "S":  # the baby recipe's shape is S; other shapes override it
        overrides += [f"--{k}={v}" for k, v in shape.items()]
    cmd = [args.peer_python, "train.py", "config/train_shakespeare_char.py", *overrides]
    env = os.environ | {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
    log = out / "nanogpt.log"
    print(f"[{name} nanoGPT] {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            f.write(line)
            f.flush()
            if line.startswith("step "):
                print(f"[{name} nanoGPT] {line.rstrip()}", flush=True)
        rc = proc.wait()
    wall = time.perf_counter() - t0
    text = log.read_text()
    if rc != 0:
        raise SystemExit(f"nanoGPT failed ({rc}); see {log}:\n{text[-2000:]}")
    evals = parse_nanogpt_evals(text)
    ms = parse_nanogpt_iter_ms(text, skip={0} | {s for s, _, _ in evals})
    per_step = shape["batch_size"] * shape["block_size"]
    # the median logged step (no start-up, no eval); else the whole run's wall time, evals included
    ms_med = sorted(ms)[len(ms) // 2] if ms else wall * 1e3 / max(args.iters, 1)
    return {
        "curve": [(s * per_step, va / LN2) for s, _, va in evals],
        "train_curve": [(s * per_step, tr / LN2) for s, tr, _ in evals],
        "tokens_per_s": per_step / (ms_med / 1e3),
        "ms_per_step_median": ms_med,
        "wall_s": wall,
        "eval_tokens_sampled": args.eval_iters * per_step,
        "command": cmd[1:],
    }


def lm_overrides(args, shape: dict, data: dict, cache: pathlib.Path) -> list[str]:
    d, seq = shape["n_embd"], shape["block_size"]
    keys = {
        "model.vocab_size": 259,  # the byte tokenizer: 256 bytes + BOS, EOS, PAD
        "model.d_model": d,
        "model.n_layers": shape["n_layer"],
        "model.n_heads": shape["n_head"],
        "model.n_kv_heads": shape["n_head"],
        "model.d_ff": swiglu_d_ff(d),
        "model.max_seq_len": seq,
        "model.compute_dtype": args.dtype,
        "data.corpus": data["corpus"],
        "data.tokenizer": "byte",
        "data.curate": "false",
        "data.heldout_fraction": args.heldout_fraction,
        "data.seq_len": seq,
        "data.cache_dir": cache,
        "train.steps": args.iters,
        "train.batch_size": shape["batch_size"],
        "train.sample_tokens": 0,
        "train.log_every": max(1, min(10, args.eval_every)),
        "eval.every_steps": args.eval_every,
        "eval.batches": 1,  # the loop's own held-out loss; the figures come from eval.sets
        "eval.sets": f"{EVAL_SET}={data['eval_set']}",
        "eval.set_tokens": data["eval_bytes"] + data["eval_files"] + 1,
        "checkpoint.every_steps": args.iters,
    }
    return [f"{k}={v}" for k, v in keys.items()]


def run_lm(args, shape: dict, name: str, recipe: str, extra: list[str], data: dict, out: pathlib.Path) -> dict:
    workdir = out / recipe
    shutil.rmtree(workdir, ignore_errors=True)
    overrides = lm_overrides(args, shape, data, pathlib.Path(args.workdir) / "lm-cache") + extra
    lm_bin = pathlib.Path(sys.executable).parent / "lm"
    cmd = [str(lm_bin), "train", "--config", str(REPO / "configs" / "tiny.py"), "--workdir", str(workdir)]
    cmd += ["--no-progress", *(f"--config.{o}" for o in overrides)]
    print(f"[{name} {recipe}] lm train ... {' '.join(extra)}", flush=True)
    t0 = time.perf_counter()
    log = out / f"{recipe}.log"
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"lm train failed ({rc}); see {log}: {log.read_text().strip().splitlines()[-1:]}")
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    per_step = shape["batch_size"] * shape["block_size"]
    summary = json.loads((workdir / "summary.json").read_text())
    stats = json.loads((workdir / "data_stats.json").read_text())
    curve = [(r["step"] * per_step, r[BPB_KEY]) for r in rows if BPB_KEY in r]
    for r in rows:
        if BPB_KEY in r:
            print(f"[{name} {recipe}] step {r['step']}: held-out {r[BPB_KEY]:.4f} bits/byte", flush=True)
    return {
        "curve": curve,
        "eval_loss_curve": [(r["step"] * per_step, r["eval_loss"]) for r in rows if "eval_loss" in r],
        "tokens_per_s": summary.get("run_tokens_per_s"),
        "wall_s": wall,
        "train_bytes": stats.get("train_bytes", stats.get("total", {}).get("train_bytes")),
        "overrides": overrides,
    }


def cached(path: pathlib.Path, key: dict, fn) -> dict:
    """fn()'s result, or the one a previous run with the same key left at `path`."""
    if path.is_file():
        old = json.loads(path.read_text())
        if old.get("key") == key:
            print(f"reusing {path}", flush=True)
            return old
    result = fn() | {"key": key}
    path.write_text(json.dumps(result, indent=1, default=float))
    return result


def muon_available() -> bool:
    return "optimizer" in (REPO / "lm" / "config" / "optim.py").read_text()


# ---- report ----


def plot(path: pathlib.Path, name: str, runs: dict, fractions: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, r in runs.items():
        xs, ys = zip(*r["curve"])
        ax.plot([x / 1e6 for x in xs], ys, "o-", label=label, ms=3)
    if "nanoGPT" in runs:
        ax.axhline(runs["nanoGPT"]["curve"][-1][1], color="gray", ls=":", lw=1, label="nanoGPT final")
    for i, (label, f) in enumerate(fractions.items()):
        if f["tokens"] is not None:  # labels stacked upwards so that close crossings stay legible
            ax.axvline(f["tokens"] / 1e6, color="gray", ls="--", lw=0.8)
            xy = (f["tokens"] / 1e6, f["target_bpb"])
            ax.annotate(f"{label}: {f['fraction']:.2f}x", xy, (4, 6 + 14 * i), textcoords="offset points", fontsize=8)
    ax.set(xlabel="training tokens (M)", ylabel="held-out bits per byte", title=f"shape {name}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(name: str, runs: dict) -> dict:
    labels = list(runs)
    print(f"\n[{name}] held-out bits per byte")
    print("  ".join(f"{h:>12}" for h in ["tokens", *labels]))
    points = sorted({t for r in runs.values() for t, _ in r["curve"]})
    for t in points:
        cells = [dict(r["curve"]).get(t) for r in runs.values()]
        print("  ".join([f"{t:>12,}", *(f"{c:>12.4f}" if c is not None else f"{'-':>12}" for c in cells)]))
    fractions = {}
    if "nanoGPT" in runs:
        for label in labels[1:]:
            f = fractions[label] = fraction_of_peer(runs[label]["curve"], runs["nanoGPT"]["curve"])
            said = f"{f['fraction']:.3f} ({f['tokens']:,.0f} tokens)" if f["tokens"] is not None else "not reached"
            print(f"[{name}] {label} reaches nanoGPT's final {f['target_bpb']:.4f} bits/byte at {said}")
    for label, r in runs.items():
        tps = r.get("tokens_per_s") or float("nan")
        r["wall_tokens_per_s"] = r["curve"][-1][0] / r["wall_s"]  # start-up, compile and evals included
        print(
            f"[{name}] {label}: final {r['curve'][-1][1]:.4f} bits/byte, {tps:.0f} tokens/s "
            f"({r['wall_tokens_per_s']:.0f} over the whole run's wall time)"
        )
    return fractions


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="S", help="comma-separated: S (the baby GPT), M (8 x 512, 8 heads)")
    p.add_argument("--iters", type=int, default=2000, help="training iterations (the horizon) of each side")
    p.add_argument("--eval-every", type=int, default=250, help="iterations between held-out evals")
    p.add_argument("--eval-bytes", type=int, default=131072, help="held-out bytes both sides are scored on")
    p.add_argument("--eval-iters", type=int, default=0, help="nanoGPT eval batches (0: about --eval-bytes)")
    p.add_argument("--heldout-fraction", type=float, default=0.1, help="files held out (by a hash of the path)")
    p.add_argument("--dtype", default="float32", help="lm's compute dtype (nanoGPT on CPU is float32)")
    p.add_argument("--workdir", help="default runs/token-efficiency-<time>")
    p.add_argument("--peer-python", help="a Python with torch, e.g. /tmp/torch-venv/bin/python")
    p.add_argument("--nanogpt", help="a nanoGPT checkout, e.g. /tmp/nanoGPT")
    p.add_argument("--lm-override", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for lm")
    p.add_argument("--muon", choices=["auto", "yes", "no"], default="auto", help="also run lm with " + " ".join(MUON))
    p.add_argument("--max-corpus-bytes", type=int, default=0, help="use only this many bytes of the stdlib (0: all)")
    p.add_argument("--quick", action="store_true", help="a tiny smoke setting (~1-2 min)")
    args = p.parse_args(argv)
    if args.quick:
        args.shapes, args.iters, args.eval_every, args.eval_bytes = "quick", 10, 5, 8192
        args.max_corpus_bytes = args.max_corpus_bytes or 1_500_000
    if set(args.shapes.split(",")) - set(SHAPES):
        p.error(f"--shapes: expected names from {sorted(SHAPES)}")
    if args.iters % args.eval_every:
        p.error("--iters must be a multiple of --eval-every (both sides then evaluate at the horizon)")
    workdir = pathlib.Path(args.workdir or REPO / "runs" / f"token-efficiency-{time.strftime('%Y%m%d-%H%M%S')}")
    workdir.mkdir(parents=True, exist_ok=True)
    args.workdir = str(workdir)
    peer = bool(args.peer_python and args.nanogpt)
    if not peer:
        print("note: no --peer-python/--nanogpt given; nanoGPT skipped")
    recipes = {"lm": list(args.lm_override)}
    if args.muon == "yes" or (args.muon == "auto" and muon_available()):
        recipes["lm-muon"] = [*args.lm_override, *MUON]
    elif args.muon == "auto":
        print("note: lm/config/optim.py has no optim.optimizer; the Muon recipe is not run")

    data = write_corpus(workdir, args.heldout_fraction, args.eval_bytes, args.max_corpus_bytes)
    print(
        f"data: {data['files']} files, train {data['train_files']} files / {data['train_bytes']:,} bytes, "
        f"held-out {data['heldout_files']} files / {data['heldout_bytes']:,} bytes, scored: "
        f"{data['eval_files']} files / {data['eval_bytes']:,} bytes; {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    copy = nanogpt_copy(pathlib.Path(args.nanogpt), workdir, data) if peer else None
    out = {"data": {k: v for k, v in data.items() if not k.startswith("_")}, "shapes": {}, "failed": {}}
    failed, eval_iters = out["failed"], args.eval_iters
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        args.eval_iters = eval_iters or eval_iters_for(data["eval_bytes"], shape)
        sdir = workdir / name
        sdir.mkdir(exist_ok=True)
        key = dict(shape=shape, iters=args.iters, eval_every=args.eval_every, eval_bytes=data["eval_bytes"])
        runs = {}
        if peer:
            k = key | {"eval_iters": args.eval_iters, "peer": "nanoGPT"}
            runs["nanoGPT"] = cached(sdir / "nanoGPT.json", k, lambda: run_nanogpt(args, shape, name, copy, sdir))
        for recipe, extra in recipes.items():
            k = key | {"dtype": args.dtype, "overrides": extra}
            try:
                runs[recipe] = cached(
                    sdir / f"{recipe}.json", k, lambda: run_lm(args, shape, name, recipe, extra, data, sdir)
                )
            except RuntimeError as e:  # one recipe failing leaves the others' figures standing
                print(f"note: {recipe} left out: {e}", flush=True)
                failed[f"{name}/{recipe}"] = str(e)
                continue
            if runs[recipe].get("train_bytes") not in (None, data["train_bytes"]):
                print(f"note: lm trained on {runs[recipe]['train_bytes']:,} bytes, nanoGPT on {data['train_bytes']:,}")
        fractions = report(name, runs)
        png = workdir / f"token_efficiency_{name}.png"
        plot(png, name, runs, fractions)
        out["shapes"][name] = {"shape": shape, "iters": args.iters, "eval_iters": args.eval_iters}
        out["shapes"][name] |= {"runs": runs, "fractions": fractions, "plot": str(png)}
    path = workdir / "token_efficiency.json"
    path.write_text(json.dumps(out, indent=1, default=float))
    print(f"wrote {path} and the plots beside it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
