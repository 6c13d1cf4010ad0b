"""Reading curation inputs: file discovery and one record stream per file format.

Formats: JSON Lines (`.jsonl`, `.jsonl.gz`, `.jsonl.zst`, one document per line in
a `text` field), Parquet (a `text` column), and any other text file as one document.
Every record comes out as a `Record`: either text to curate, or a `problem` saying
why it is unreadable (the caller raises or counts it, per `curate.on_bad_record`).
Bytes are the UTF-8 bytes of a document's text (raw bytes for an unreadable record).
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lm.data.corpus import _glob_root, _is_hidden, _looks_binary, resolve_corpus
from lm.errors import UserError

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
DATA_SUFFIXES = JSONL_SUFFIXES + (".parquet",)  # formats read as records, even though binary
BAD_RECORDS = "bad_records"  # under a run's work dir: the records each task skipped (on_bad_record=skip)


@dataclass(frozen=True)
class Record:
    where: str  # "file" or "file:line" (line/row numbers are 1-based)
    nbytes: int
    text: str = ""
    record_id: str = ""
    problem: str = ""  # non-empty: the record is unreadable, and this says why


@dataclass(frozen=True)
class InputFile:
    path: str
    rel: str  # path relative to its input's root: stable document ids across machines


def _is_data_file(path: Path) -> bool:
    return path.name.endswith(DATA_SUFFIXES)


def input_name(label: str, spec: str) -> str:
    """How messages name an input: "--input 'x'" for the command line, "data.corpus = 'x'" for a config key."""
    return f"{label} '{spec}'" if label.startswith("-") else f"{label} = '{spec}'"


def _candidates(spec: str, label: str) -> tuple[Path, list[Path]]:
    if set("*?[") & set(spec):
        return _glob_root(spec), [Path(p) for p in glob.glob(spec, recursive=True)]
    path = Path(spec)
    if not path.exists():
        raise UserError(f"{input_name(label, spec)} does not exist; give a file, a directory, a glob, or 'stdlib'")
    if path.is_file():
        return path.parent, [path]
    return path, list(path.rglob("*"))


def discover(specs: list[str], labels: list[str] | None = None) -> tuple[list[InputFile], list[str]]:
    """All input files of the specs, sorted per spec, and the binary files that were skipped.

    `labels` name each spec in messages (default '--input'; e.g. 'data.sources[1]')."""
    files, skipped = [], []
    for spec, label in zip(specs, labels or ["--input"] * len(specs)):
        if spec == "stdlib":
            root, paths = resolve_corpus(spec)
        else:
            root, paths = _candidates(spec, label)
            paths = [p for p in paths if p.is_file() and not _is_hidden(p.relative_to(root))]
            skipped += [str(p) for p in paths if not _is_data_file(p) and _looks_binary(p)]
            paths = [p for p in paths if _is_data_file(p) or not _looks_binary(p)]
        if not paths:
            raise UserError(f"{input_name(label, spec)} names no readable files (hidden and binary files are skipped)")
        files += [InputFile(str(p), p.relative_to(root).as_posix()) for p in sorted(paths)]
    return files, sorted(skipped)


def _utf8_problem(raw: bytes, err: UnicodeDecodeError, first_line: int = 1) -> tuple[int, str]:
    line = first_line + raw.count(b"\n", 0, err.start)
    return line, f"invalid UTF-8 (byte 0x{raw[err.start]:02x}); expected UTF-8 text"


def read_text_file(f: InputFile) -> Iterator[Record]:
    raw = Path(f.path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line, problem = _utf8_problem(raw, e)
        yield Record(f"{f.path}:{line}", len(raw), problem=problem)
        return
    yield Record(f.path, len(raw), text, f.rel)


def _open_binary(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def _decompression_errors() -> tuple[type[BaseException], ...]:
    errors = (OSError, EOFError, zlib.error)
    try:
        import zstandard

        return errors + (zstandard.ZstdError,)
    except ImportError:
        return errors


def _jsonl_record(f: InputFile, lineno: int, raw: bytes, text_key: str) -> Record:
    where = f"{f.path}:{lineno}"
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return Record(where, len(raw), problem=_utf8_problem(raw, e, lineno)[1])
    except json.JSONDecodeError as e:
        return Record(
            where, len(raw), problem=f"not valid JSON ({e.msg} at column {e.colno}); expected one JSON object per line"
        )
    if not isinstance(obj, dict) or not isinstance(obj.get(text_key), str):
        found = f"keys {sorted(obj)[:8]}" if isinstance(obj, dict) else type(obj).__name__
        return Record(
            where, len(raw), problem=f'no string field \'{text_key}\' (found {found}); expected {{"{text_key}": "..."}}'
        )
    text = obj[text_key]
    record_id = obj.get("id")
    return Record(
        where, len(text.encode("utf-8")), text, str(record_id) if record_id is not None else f"{f.rel}:{lineno}"
    )


def read_jsonl(f: InputFile, text_key: str) -> Iterator[Record]:
    lineno = 0
    try:
        with _open_binary(f.path) as stream:
            for lineno, raw in enumerate(stream, start=1):
                if raw.strip():
                    yield _jsonl_record(f, lineno, raw.rstrip(b"\r\n"), text_key)
    except _decompression_errors() as e:  # truncated or corrupt compressed data
        yield Record(f"{f.path}:{lineno + 1}", 0, problem=f"unreadable compressed data ({type(e).__name__}: {e})")


def read_parquet(f: InputFile, text_key: str) -> Iterator[Record]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(f.path)
    except Exception as e:  # pyarrow raises its own error types for non-Parquet bytes
        yield Record(f.path, Path(f.path).stat().st_size, problem=f"not a readable Parquet file ({e})")
        return
    if text_key not in pf.schema_arrow.names:
        yield Record(
            f.path,
            Path(f.path).stat().st_size,
            problem=f"no column '{text_key}' (columns: {pf.schema_arrow.names}); expected a string column",
        )
        return
    row = 0
    for batch in pf.iter_batches(columns=[text_key]):
        for text in batch.column(0).to_pylist():
            row += 1
            where = f"{f.path}:{row}"
            if not isinstance(text, str):
                yield Record(where, 0, problem=f"row {row}: '{text_key}' is {text!r}; expected a string")
            else:
                yield Record(where, len(text.encode("utf-8")), text, f"{f.rel}:{row}")


def read_records(f: InputFile, text_key: str) -> Iterator[Record]:
    if f.path.endswith(JSONL_SUFFIXES):
        return read_jsonl(f, text_key)
    if f.path.endswith(".parquet"):
        return read_parquet(f, text_key)
    return read_text_file(f)
