"""Training-data contamination of evaluation sets: word n-gram overlap, as in GPT-3's analysis.

An evaluation example is contaminated when any n consecutive words of it (n = 13 by default)
also occur, consecutively, within one training document. An example of fewer than n words is
checked whole (its k words as one k-gram), unless it has fewer than `min_words` (default 8): so
few words turn up by chance in any large corpus, so a match would say nothing; such examples are
counted as too short to check: neither contaminated nor clean (`n/a: too short`), and left out of
the clean subset.

The training side is streamed: documents are read in chunks of a few MB of text, the hashes of
every window of each needed length are computed with numpy (lm.eval.ngrams) and looked up in the
sorted hashes of the evaluation n-grams. Memory is that of the evaluation n-grams and one chunk.

Training inputs: a token shard directory (`lm tokenize`, the pretraining cache: its train split)
or one split of it, decoded with the tokenizer; or a corpus spec (`stdlib`, a directory, a glob,
a file) of plain files (one document each) and JSONL lines {text}, chat {messages}, {prompt,
answer} or preference {prompt, chosen, rejected} (one document per line, all its text).

A file named on its own that is not text (a NUL byte, or not UTF-8) is refused, naming it;
directories and globs skip binary files (a NUL byte in their head), as every corpus reader does.

Report: {"n", "min_words", "train": {"specs", "documents", "bytes", "seconds", "mb_per_s"}, "tasks":
{FILE STEM: {"path", "examples", "checked", "too_short", "contaminated", "fraction" (of checked;
null when no example was long enough to check), "ids" (line numbers), "too_short_ids", "samples":
[{"id", "ngram"}]}}}. `clean_subset` rescores an `lm eval` report on the clean examples: checked and
not contaminated.
"""

from __future__ import annotations

import codecs
import dataclasses
import pathlib
import time

import numpy as np

from lm.data.corpus import is_jsonl, iter_documents, resolve_corpus
from lm.data.jsonl import ONE_OBJECT, iter_jsonl
from lm.data.progress import bars
from lm.data.shards import is_shard_dir, open_shards, read_manifest
from lm.data.tokenizer import load_tokenizer
from lm.errors import UserError
from lm.eval import ngrams
from lm.eval.sets import lm_metrics
from lm.eval.taskfile import read_task_file

N = 13
MIN_WORDS = 8
CHUNK_BYTES = 4 << 20  # training text hashed per numpy pass
SAMPLES = 5  # matched n-grams shown per eval file
TRAIN_KEYS = ("text", "prompt", "answer", "chosen", "rejected", "messages")
SHAPES = '{"context", "choices", "answer"}, {"prompt", "answer"}, {"messages": [{"role", "content"}, ...]} or {"text"}'


def example_text(obj: dict, where: str) -> str:
    """The text checked for one eval example (the shapes `lm eval` reads)."""
    if isinstance(obj.get("choices"), list) and isinstance(obj.get("context"), str):
        choices, answer = obj["choices"], obj.get("answer")
        if isinstance(answer, str) and answer in choices:
            answer = choices.index(answer)
        if (
            isinstance(answer, int)
            and not isinstance(answer, bool)
            and 0 <= answer < len(choices)
            and isinstance(choices[answer], str)
        ):
            return f"{obj['context']} {choices[answer]}"
        raise UserError(f"{where}: 'answer' is {answer!r}; expected an index into 'choices' or one of them")
    if isinstance(obj.get("messages"), list):
        if all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in obj["messages"]):
            return " ".join(m["content"] for m in obj["messages"])
        raise UserError(f"{where}: every message must be an object with a string 'content'")
    if isinstance(obj.get("prompt"), str) and "answer" in obj:
        answers = [obj["answer"]] if isinstance(obj["answer"], str) else obj["answer"]
        if isinstance(answers, list) and all(isinstance(a, str) for a in answers):
            return " ".join([obj["prompt"], *answers])
    if isinstance(obj.get("text"), str):
        return obj["text"]
    raise UserError(f"{where}: keys {sorted(obj)}; expected {SHAPES}")


def read_examples(path: str) -> list[tuple[int, str]]:
    """(line number, checked text) of each example of a task JSONL file."""

    return [(n, example_text(obj, f"{path}:{n}")) for n, obj in read_task_file(path)]


@dataclasses.dataclass
class EvalNgrams:
    """The n-grams of every example of the eval files, each k-gram length apart."""

    words: list[list[str]]  # per example
    lengths: np.ndarray  # words per example
    grams: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]  # k -> (hash, example, start in it) per k-gram
    lookup: ngrams.Lookup  # k -> the distinct hashes

    @classmethod
    def build(cls, texts: list[str], n: int, min_words: int, word_hashes) -> EvalNgrams:
        ws = [ngrams.words(t) for t in texts]
        lengths = np.array([len(w) for w in ws], np.int64)
        docs = np.repeat(np.arange(len(ws)), lengths)
        flat = word_hashes.array([w for example in ws for w in example])
        ks = {n} | {int(k) for k in lengths if min_words <= k < n}
        grams = {}
        for k, (h, starts) in ngrams.ngram_hashes(flat, docs, ks).items():
            example = docs[starts]
            keep = np.ones(len(h), bool) if k == n else lengths[example] == k  # short ones: whole only
            first = np.concatenate([[0], np.cumsum(lengths)])[example[keep]]
            grams[k] = (h[keep], example[keep], starts[keep] - first)
        return cls(ws, lengths, grams, ngrams.Lookup({k: g[0] for k, g in grams.items()}))


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, dict) and "content" in value:
        yield from _strings(value["content"])


def _train_text(obj) -> str:
    """All the text of one training JSONL record."""
    texts = [s for k in TRAIN_KEYS if isinstance(obj, dict) for s in _strings(obj.get(k))]
    if not texts:
        raise ValueError(
            'no text; expected {"text"}, chat {"messages"}, {"prompt", "answer"} or {"prompt", "chosen", "rejected"}'
        )
    return " ".join(texts)


def _jsonl_docs(path: pathlib.Path):
    """(text, bytes of its line) of each record of a training JSONL file."""
    for _, text, size in iter_jsonl(path, _train_text, expected=ONE_OBJECT, with_size=True):
        yield text, size


def _shard_set(spec: str, tokenizer):

    directory = pathlib.Path(spec) / "train" if is_shard_dir(spec) else pathlib.Path(spec)
    if tokenizer is None:
        name = read_manifest(directory)["tokenizer"]["name"]
        if name != "byte":
            raise UserError(f"--train {spec}: a shard set tokenized with '{name}'; give --tokenizer PATH.model")
        tokenizer = "byte"
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    return open_shards(directory, tok), tok


def training_source(spec: str, tokenizer=None):
    """(total bytes, iterator of (document text, its bytes)) of one training input spec."""

    if is_shard_dir(spec) or (pathlib.Path(spec) / "manifest.json").is_file():
        shards, tok = _shard_set(spec, tokenizer)

        def docs():
            for i in range(shards.n_docs):
                ids = shards.doc(i)
                text = tok.decode(ids[:-1] if len(ids) and ids[-1] == tok.eos_id else ids)
                yield text, len(text.encode("utf-8"))

        return shards.manifest["n_bytes"], docs()
    _, files = resolve_corpus(spec, "--train")
    if pathlib.Path(spec).is_file() and not is_jsonl(pathlib.Path(spec)):  # directories skip binary files
        _check_text(pathlib.Path(spec))

    def docs():
        for path in files:
            if is_jsonl(path):
                yield from _jsonl_docs(path)
            else:
                for doc, _ in iter_documents(path):
                    yield doc.decode("utf-8", errors="replace"), len(doc)

    return sum(p.stat().st_size for p in files), docs()


def _check_text(path: pathlib.Path, block: int = 1 << 20) -> None:
    """A UserError naming `path` unless it is UTF-8 text without NUL bytes (read in blocks)."""
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as f:
        while True:
            data = f.read(block)
            problem = f"a NUL byte at byte {offset + data.index(0) + 1}" if 0 in data else None
            pending = len(decoder.getstate()[0])  # bytes of a character the last block cut
            try:
                decoder.decode(data, final=not data)
            except UnicodeDecodeError as e:
                problem = problem or f"not UTF-8 at byte {offset - pending + e.start + 1}"
            if problem:
                raise UserError(
                    f"--train {path}: not a text file ({problem}); expected UTF-8 text, JSONL "
                    "or a token shard directory (`lm tokenize`)"
                )
            if not data:
                return
            offset += len(data)


def _chunks(sources, bar):
    """Lists of document texts of about CHUNK_BYTES each, over all sources."""
    chunk, size = [], 0
    for _, docs in sources:
        for text, n_bytes in docs:
            chunk.append(text)
            size += n_bytes
            bar.update(n_bytes)
            if size >= CHUNK_BYTES:
                yield chunk, size
                chunk, size = [], 0
    if chunk:
        yield chunk, size


def scan(sources, index: EvalNgrams, word_hashes, progress: bool = True) -> tuple[dict, dict]:
    """Streams training documents: ({k: matched eval hashes}, {documents, bytes, seconds})."""
    from tqdm import tqdm

    found = {k: np.zeros(0, np.uint64) for k in index.grams}
    stats, t0 = {"documents": 0, "bytes": 0}, time.perf_counter()
    with tqdm(
        total=sum(total for total, _ in sources),
        unit="B",
        unit_scale=True,
        desc="contamination",
        disable=not bars(progress),
    ) as bar:
        for texts, size in _chunks(sources, bar):
            ws = [ngrams.fast_words(t) for t in texts]
            docs = np.repeat(np.arange(len(ws)), [len(w) for w in ws])
            flat = word_hashes.array([w for doc in ws for w in doc])
            for k, (h, _) in ngrams.ngram_hashes(flat, docs, index.grams).items():
                hit = index.lookup.hits(k, h)
                if len(hit):
                    found[k] = np.union1d(found[k], hit)
            stats["documents"] += len(texts)
            stats["bytes"] += size
    stats["seconds"] = time.perf_counter() - t0
    return found, stats


def _task_key(path: str, taken: dict) -> str:
    stem = pathlib.Path(path).stem
    return stem if stem not in taken else path


def check(
    train_specs: list[str],
    eval_files: list[str],
    *,
    n: int = N,
    min_words: int | None = None,
    tokenizer=None,
    progress: bool = True,
) -> dict:
    """The contamination report of `eval_files` (task JSONL) against the training inputs.

    `min_words` defaults to min(MIN_WORDS, n); `tokenizer` ('byte', a .model path or a tokenizer)
    decodes shard sets and may be left out for byte-level ones."""
    min_words = min(MIN_WORDS, n) if min_words is None else min_words
    if n < 1 or not 1 <= min_words <= n:
        raise UserError(f"contamination: n={n}, min_words={min_words}; expected 1 <= min_words <= n")
    if not train_specs or not eval_files:
        raise UserError("contamination: give at least one training input and one eval file")
    eval_files = list(dict.fromkeys(eval_files))
    examples = [(f, line, text) for f in eval_files for line, text in read_examples(f)]
    word_hashes = ngrams.WordHashes()
    index = EvalNgrams.build([t for _, _, t in examples], n, min_words, word_hashes)
    sources = [training_source(s, tokenizer) for s in train_specs]  # every spec checked before the scan
    found, stats = scan(sources, index, word_hashes, progress)
    first_hit = {}  # example -> (start, k) of its first matched n-gram
    for k, (h, example, start) in index.grams.items():
        hit = np.isin(h, found[k])
        for e, s in zip(example[hit].tolist(), start[hit].tolist()):
            first_hit[e] = min(first_hit.get(e, (s, k)), (s, k))
    tasks = {}
    for f in eval_files:
        mine = [i for i, ex in enumerate(examples) if ex[0] == f]
        too_short = [examples[i][1] for i in mine if int(index.lengths[i]) < min_words]
        short = len(too_short)
        dirty = [i for i in mine if i in first_hit]
        samples = [
            {"id": examples[i][1], "ngram": " ".join(index.words[i][s : s + k])}
            for i in dirty[:SAMPLES]
            for s, k in [first_hit[i]]
        ]
        tasks[_task_key(f, tasks)] = {
            "path": f,
            "examples": len(mine),
            "checked": len(mine) - short,
            "too_short": short,
            "contaminated": len(dirty),
            "fraction": len(dirty) / (len(mine) - short) if len(mine) > short else None,
            "ids": [examples[i][1] for i in dirty],
            "too_short_ids": too_short,
            "samples": samples,
        }
    seconds = stats["seconds"]
    train = {"specs": list(train_specs), **stats, "mb_per_s": stats["bytes"] / 1e6 / max(seconds, 1e-9)}
    return {"n": n, "min_words": min_words, "train": train, "tasks": tasks}


def _metrics(entry: dict, keep: np.ndarray) -> dict:
    """Means of the per-example scores; language modelling: loss, perplexity and bits per byte
    from the sums (bits per byte over `text_nats`, control tokens excluded, when the report has them)."""
    per = entry["per_example"]
    if {"nats", "bytes", "tokens"} <= set(per):  # language modelling: ratios of sums, not means
        return lm_metrics({"text_nats": per["nats"], **per}, keep)
    return {name: float(np.asarray(v, np.float64)[keep].mean()) for name, v in per.items()}


def _same_file(a: str, b: str) -> bool:
    return pathlib.Path(a).resolve() == pathlib.Path(b).resolve()


def clean_subset(eval_report: dict, contamination: dict) -> dict:
    """Scores of each `lm eval` task read from a checked file, over all and the clean examples (checked
    and not contaminated: an example too short to check is neither, `n_too_short`)."""
    out = {}
    for name, entry in eval_report.get("tasks", {}).items():
        match = [t for t in contamination["tasks"].values() if _same_file(entry.get("path", ""), t["path"])]
        if not match or not entry.get("per_example"):
            continue
        dirty, ids = set(match[0]["ids"]), entry.get("example_ids") or []
        short = set(match[0].get("too_short_ids", ()))
        for metric, values in entry["per_example"].items():
            if len(values) != len(ids):
                raise UserError(
                    f"eval report task '{name}': {len(values)} '{metric}' scores for {len(ids)} "
                    "example_ids; expected one per example (an `lm eval --out` report)"
                )
        keep = np.array([i not in dirty and i not in short for i in ids], bool)
        out[name] = {
            "n_clean": int(keep.sum()),
            "n_contaminated": sum(i in dirty for i in ids),
            "n_too_short": sum(i in short for i in ids),
            "metrics_all": _metrics(entry, np.ones(len(ids), bool)),
            "metrics_clean": _metrics(entry, keep) if keep.any() else {},
        }
    return out


def table(report: dict, clean: dict | None = None) -> str:
    """Per eval file: examples, checked, contaminated, fraction (and the clean-subset scores)."""
    t = report["train"]
    lines = [
        f"{report['n']}-gram overlap with {t['documents']:,} training documents "
        f"({t['bytes'] / 1e6:,.1f} MB, {t['mb_per_s']:.1f} MB/s)",
        f"{'eval file':<24} {'examples':>8} {'checked':>8} {'contam.':>8} {'fraction':>9}",
    ]
    for name, r in report["tasks"].items():
        fraction = "n/a" if r["fraction"] is None else f"{r['fraction']:.2%}"
        lines.append(f"{name:<24} {r['examples']:>8} {r['checked']:>8} {r['contaminated']:>8} {fraction:>9}")
        if r["fraction"] is None:
            lines.append(
                f"    n/a: all {r['examples']} examples are shorter than --min-words ({report['min_words']} "
                "words), too short to check"
            )
        lines += [f'    line {s["id"]}: "{s["ngram"]}"' for s in r["samples"]]
    for name, c in (clean or {}).items():
        short = c.get("n_too_short", 0)
        lines.append(
            f"{name}: clean {c['n_clean']}, contaminated {c['n_contaminated']}"
            + (f", n/a: too short {short}" if short else "")
        )
        for m, v in c["metrics_all"].items():
            after = c["metrics_clean"].get(m)
            shown = f"{after:>10.4f}" if after is not None else ("n/a: too short" if short else "n/a")
            lines.append(f"    {m:<14} all {v:>10.4f}   clean {shown}")
    return "\n".join(lines)
