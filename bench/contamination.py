"""Contamination check throughput (MB/s of training text) against a pure-Python peer.

Training text: the first --max-mb of the interpreter's standard library (all of it, ~31 MB, by
default), files in sorted order. Eval set: --examples examples, half of them spans of 20-60
words copied from stdlib files (contaminated), half random words drawn from the stdlib's
vocabulary (clean); a --short share of the examples has 8-12 words (checked whole, so each
distinct length is one more k-gram length to hash on the training side).

Ours: `lm.eval.contamination.check` (hashed n-grams, numpy, streamed in chunks). The peer: the
straightforward implementation, a Python set of word tuples per needed length and a sliding
window over each training document's words (same reading, same normalisation), once with the
regex split and once (peer*) with our faster split, to tell the gain of hashing from that of
splitting. All are timed over the whole call (reading, indexing the eval set, scanning) in
interleaved rounds, and must flag the same examples.

    PYTHONPATH=. python bench/contamination.py [--max-mb 0] [--rounds 3] [--short 0.1] [--out figures.json]

Prints figures only; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

from lm.data.corpus import iter_documents, stdlib_files
from lm.eval import ngrams
from lm.eval.contamination import MIN_WORDS, N, check, read_examples

WORD = re.compile(r"\w+")


def capped_stdlib(dest: Path, max_bytes: int) -> int:
    """Links stdlib files into `dest` until max_bytes (0 = all); returns the bytes linked."""
    total, root = 0, Path(sysconfig.get_paths()["stdlib"])
    for path in stdlib_files():
        size = path.stat().st_size
        if max_bytes and total + size > max_bytes:
            break
        (dest / path.relative_to(root).as_posix().replace("/", "__")).symlink_to(path)
        total += size
    return total


def eval_set(train: Path, path: Path, examples: int, short: float, seed: int = 0) -> None:
    import numpy as np

    rng = np.random.default_rng(seed)
    files = sorted(train.iterdir())
    texts = [f.read_text(errors="replace").split() for f in rng.choice(files, 50)]
    vocab = sorted({w for t in texts for w in t})
    rows = []
    for i in range(examples):
        n = int(rng.integers(8, 13)) if i < short * examples else int(rng.integers(20, 61))
        if i % 2:
            rows.append({"text": " ".join(rng.choice(vocab, n))})
        else:
            t = texts[i % len(texts)]
            at = int(rng.integers(0, max(len(t) - n, 1)))
            rows.append({"prompt": " ".join(t[at : at + n - 1]), "answer": " ".join(t[at + n - 1 : at + n])})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def regex_split(text: str) -> list[str]:
    return WORD.findall(text.lower())


def fast_split(text: str) -> list[bytes]:
    """Our word splitting (bytes.translate for ASCII text), the words as bytes either way."""
    ws = ngrams.fast_words(text)
    return ws if text.isascii() else [w.encode("utf-8", errors="surrogatepass") for w in ws]


def peer(train: Path, eval_file: Path, split=regex_split, n: int = N, min_words: int = MIN_WORDS) -> list[int]:
    """Contaminated line numbers: tuples of words in Python sets, a sliding window per document."""
    examples = [(line, split(text)) for line, text in read_examples(str(eval_file))]
    grams: dict[int, set] = {}
    for _, ws in examples:
        if len(ws) >= n:
            grams.setdefault(n, set()).update(tuple(ws[i : i + n]) for i in range(len(ws) - n + 1))
        elif len(ws) >= min_words:
            grams.setdefault(len(ws), set()).add(tuple(ws))
    found = set()
    for path in sorted(train.iterdir()):
        for doc, _ in iter_documents(path):
            ws = split(doc.decode("utf-8", errors="replace"))
            for k, targets in grams.items():
                found.update(g for g in (tuple(ws[i : i + k]) for i in range(len(ws) - k + 1)) if g in targets)
    dirty = []
    for line, ws in examples:
        k = n if len(ws) >= n else len(ws)
        if len(ws) >= min_words and any(tuple(ws[i : i + k]) in found for i in range(len(ws) - k + 1)):
            dirty.append(line)
    return dirty


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-mb", type=float, default=0, help="training text to read (0 = the whole stdlib)")
    ap.add_argument("--examples", type=int, default=2000, help="eval examples")
    ap.add_argument("--short", type=float, default=0.1, help="share of eval examples with 8-12 words")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        train, eval_file = Path(tmp) / "train", Path(tmp) / "eval.jsonl"
        train.mkdir()
        total = capped_stdlib(train, int(args.max_mb * 1e6))
        eval_set(train, eval_file, args.examples, args.short)
        print(
            f"training text: {total / 1e6:.1f} MB of the standard library; eval: {args.examples} examples, "
            f"{args.short:.0%} of 8-12 words"
        )
        print(
            f"{'round':>5} {'ours MB/s':>10} {'peer MB/s':>10} {'ours/peer':>10} {'peer*':>8} {'ours/peer*':>10}"
            "  flagged (ours, peer, peer*)"
        )
        rounds = []
        for r in range(args.rounds):
            t0 = time.perf_counter()
            ours = check([str(train)], [str(eval_file)], progress=False)["tasks"]["eval"]["ids"]
            ours_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            theirs = peer(train, eval_file)
            peer_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            theirs_fast = peer(train, eval_file, fast_split)
            fast_s = time.perf_counter() - t0
            mb = total / 1e6
            rounds.append(
                {
                    "ours_mb_per_s": mb / ours_s,
                    "peer_mb_per_s": mb / peer_s,
                    "ratio": peer_s / ours_s,
                    "peer_fast_split_mb_per_s": mb / fast_s,
                    "ratio_fast_split": fast_s / ours_s,
                    "flagged": [len(ours), len(theirs), len(theirs_fast)],
                    "agree": ours == theirs == theirs_fast,
                }
            )
            x = rounds[-1]
            print(
                f"{r + 1:>5} {x['ours_mb_per_s']:>10.1f} {x['peer_mb_per_s']:>10.1f} {x['ratio']:>10.2f} "
                f"{x['peer_fast_split_mb_per_s']:>8.1f} {x['ratio_fast_split']:>10.2f}  "
                f"{', '.join(map(str, x['flagged']))} ({'agree' if x['agree'] else 'DIFFER'})",
                flush=True,
            )
    med = {k: statistics.median(x[k] for x in rounds) for k in rounds[0] if k not in ("flagged", "agree")}
    print(
        f"median: ours {med['ours_mb_per_s']:.1f} MB/s, peer {med['peer_mb_per_s']:.1f} MB/s, "
        f"ours/peer {med['ratio']:.2f}x; peer* (our word splitting) {med['peer_fast_split_mb_per_s']:.1f} MB/s, "
        f"ours/peer* {med['ratio_fast_split']:.2f}x (medians of per-round figures)"
    )
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "train_mb": total / 1e6,
                    "examples": args.examples,
                    "short": args.short,
                    "median": med,
                    "rounds": rounds,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
