"""Data path throughput: is the loader fast enough, and does `lm tokenize` keep up with sentencepiece?

1. Loader: packed [batch, seq_len] batches per second from the real grain pipeline (shards of
   the stdlib, byte tokenizer, configs/tiny.py's seq_len and batch), on the host, against the
   tokens per second the tiny config's train step consumes on this machine. Target: >= 20x.
2. Tokenization: MB/s of `lm tokenize` (reading, splitting, encoding, writing shards and
   manifests) against sentencepiece's own encode loop over the same documents in one thread.
   Target: >= 80% with one worker; with all cores it can exceed 100%.
3. Curation (unless --no-curation): MB/s with every stage on, off, and each one alone on and
   alone off, by bench/curate_throughput.py over --curate-mb of the stdlib.

    PYTHONPATH=. python bench/data_throughput.py [--tokenize-mb 16] [--vocab 8192] [--out figures.json]

Prints figures only; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import resource
import sys
import tempfile
import time

# The train step is measured on this machine's real device(s), not 8 simulated ones.
os.environ["XLA_FLAGS"] = re.sub(
    r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")
).strip()

# Only light imports at the top: `lm tokenize`'s worker processes are spawned, and a spawned
# worker re-imports this script, as it would re-import `lm.cli` (which imports little).
from lm.data.corpus import resolve_corpus  # noqa: E402
from lm.data.shards import open_shards, tokenize_corpus, train_documents  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent


def loader_tokens_per_s(shards, seq_len: int, batch: int, n_batches: int) -> dict:
    from lm.data.pipeline import Source, train_dataset

    it = iter(train_dataset([Source("stdlib", shards, 1.0)], seq_len=seq_len, global_batch=batch, seed=0))
    next(it)  # builds the streams
    t0, real = time.perf_counter(), 0.0
    for _ in range(n_batches):
        real += float(next(it)["loss_mask"].sum())
    dt = time.perf_counter() - t0
    return {
        "tokens_per_s": n_batches * batch * seq_len / dt,
        "batches_per_s": n_batches / dt,
        "fill": real / (n_batches * batch * seq_len),
    }


def train_step_tokens_per_s(config, batch: dict, steps: int) -> dict:
    """The tiny config's real train step on this machine's devices, fed a real packed batch."""
    import jax

    from lm.train.setup import build_run

    run = build_run(config)
    state, step = run.init_state(), run.train_step()
    device_batch = run.placer()(batch)
    state, metrics = step(state, device_batch)  # compile
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, device_batch)
    jax.block_until_ready(metrics)
    dt = (time.perf_counter() - t0) / steps
    tokens = batch["inputs"].size
    return {"tokens_per_s": tokens / dt, "ms_per_step": dt * 1e3, "devices": len(jax.devices())}


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children: unlike wall time, not inflated when
    other jobs share the cores."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def raw_sentencepiece_mb_per_s(model_path: str, docs: list[str]) -> tuple[float, float]:
    """sentencepiece's own encode over the documents, one thread, text already in memory:
    (MB per wall second, MB per CPU second)."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=model_path)
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    t0, c0 = time.perf_counter(), _cpu_seconds()
    for d in docs:
        sp.encode(d)
    return n_bytes / (time.perf_counter() - t0) / 1e6, n_bytes / (_cpu_seconds() - c0) / 1e6


def tokenize_mb_per_s(corpus: str, out: pathlib.Path, tokenizer: str, workers: int) -> tuple[float, float, dict]:
    """`lm tokenize` end to end: (MB per wall second, MB per CPU second of all its processes, manifests)."""
    t0, c0 = time.perf_counter(), _cpu_seconds()
    m = tokenize_corpus(corpus, out, tokenizer, 0.02, workers=workers, progress=False)
    dt, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
    n_bytes = m["train"]["n_bytes"] + m["heldout"]["n_bytes"]
    return n_bytes / dt / 1e6, n_bytes / cpu / 1e6, m


def subset_corpus(root: pathlib.Path, mb: float) -> str:
    """The first `mb` MB of stdlib files, copied as a corpus (so `lm tokenize` reads real files)."""
    src_root, files = resolve_corpus("stdlib")
    total = 0
    for p in files:
        if total >= mb * 1e6:
            break
        dest = root / p.relative_to(src_root)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(p.read_bytes())
        total += p.stat().st_size
    return str(root)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=400, help="loader batches timed")
    p.add_argument("--steps", type=int, default=10, help="train steps timed")
    p.add_argument("--tokenize-mb", type=float, default=16.0, help="MB of stdlib text for the tokenization test")
    p.add_argument("--vocab", type=int, default=8192, help="sentencepiece vocabulary trained for the test")
    p.add_argument("--curate-mb", type=float, default=2.0, help="MB of stdlib text for the curation figures")
    p.add_argument("--no-curation", action="store_true", help="skip the curation figures")
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args(argv)
    from lm.config import load_config
    from lm.data.pipeline import Source, train_dataset
    from lm.data.tokenizer import load_tokenizer

    config = load_config(str(REPO / "configs" / "tiny.py"))
    seq, batch = config.data.seq_len, config.train.batch_size
    out = {"cores": os.cpu_count(), "load_average_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        tokenize_corpus("stdlib", tmp / "stdlib", "byte", config.data.heldout_fraction, progress=False)
        shards = open_shards(tmp / "stdlib" / "train", load_tokenizer("byte"), config.model.vocab_size)
        loader = out["loader"] = loader_tokens_per_s(shards, seq, batch, args.batches)
        print(
            f"loader: {loader['tokens_per_s']:,.0f} tokens/s ({loader['batches_per_s']:.0f} batches of "
            f"{batch}x{seq}/s, {loader['fill']:.1%} of positions carry loss)",
            flush=True,
        )
        it = iter(train_dataset([Source("stdlib", shards, 1.0)], seq_len=seq, global_batch=batch, seed=0))
        step = out["train_step"] = train_step_tokens_per_s(config, next(it), args.steps)
        ratio = out["loader_over_step"] = loader["tokens_per_s"] / step["tokens_per_s"]
        print(
            f"tiny train step: {step['tokens_per_s']:,.0f} tokens/s ({step['ms_per_step']:.0f} ms/step on "
            f"{step['devices']} device(s)); loader / step = {ratio:.0f}x (target >= 20x)",
            flush=True,
        )

        corpus = subset_corpus(tmp / "text", args.tokenize_mb)
        from lm.data.spm import train_sentencepiece

        tok = train_sentencepiece(train_documents(corpus, 0.02), tmp / "spm", args.vocab)
        docs = [
            d.decode("utf-8", errors="replace") if isinstance(d, bytes) else d
            for path in resolve_corpus(corpus)[1]
            for d in [path.read_bytes()]
            if d
        ]
        raw, raw_cpu = raw_sentencepiece_mb_per_s(str(tok.path), docs)
        out["raw_sentencepiece_mb_per_s"], out["raw_sentencepiece_mb_per_cpu_s"] = raw, raw_cpu
        print(
            f"sentencepiece encode, 1 thread: {raw:.2f} MB/s ({raw_cpu:.2f} MB per CPU second) over "
            f"{sum(len(d.encode()) for d in docs) / 1e6:.1f} MB",
            flush=True,
        )
        for workers in sorted({1, os.cpu_count() or 1}):
            mbps, per_cpu, m = tokenize_mb_per_s(corpus, tmp / f"tok{workers}", str(tok.path), workers)
            out[f"tokenize_{workers}_workers"] = {
                "mb_per_s": mbps,
                "over_raw": mbps / raw,
                "mb_per_cpu_s": per_cpu,
                "over_raw_per_cpu_s": per_cpu / raw_cpu,
            }
            print(
                f"lm tokenize, {workers} worker(s): {mbps:.2f} MB/s = {mbps / raw:.0%} of raw sentencepiece "
                f"(target >= 80%); per CPU second {per_cpu / raw_cpu:.0%} of raw; "
                f"{len(m['train']['shards'])} train shards",
                flush=True,
            )
    if not args.no_curation:
        sys.path.insert(0, str(REPO / "bench"))
        import curate_throughput

        print("curation:", flush=True)
        curate_throughput.main(["--max-mb", str(args.curate_mb)])
    out["load_average_end"] = os.getloadavg()[0]
    print(f"load average {out['load_average_start']:.1f} -> {out['load_average_end']:.1f} on {out['cores']} cores")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(out, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
