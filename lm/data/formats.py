"""How each accepted form of a records file is read into numbered raw rows (lm.data.records parses them).

  jsonl    .jsonl, .jsonl.gz: one JSON value per line, UTF-8 (a byte-order mark at the start is
           allowed), "\\n" or "\\r\\n" ends; blank lines are skipped but counted, so a row's number is
           the line an editor shows
  parquet  .parquet
  arrow    .arrow: an Arrow IPC file or stream (what datasets writes)
  dataset  a folder written by Hugging Face datasets' `save_to_disk`: its data-*.arrow files in the
           order its state.json lists them, rows numbered across the folder

Parquet and Arrow rows come as Python dicts (a list of structs as a list of dicts). A columnar table
gives every row every column and every struct every field, so a null there reads as an absent key:
the same records give the same rows in every form. pyarrow is imported only for those forms.
"""

from __future__ import annotations

import codecs
import gzip
import json
import zlib
from pathlib import Path
from typing import Iterator

from lm.errors import UserError

FORMS = "a .jsonl or .jsonl.gz file, a .parquet file, an .arrow file, or a folder written by datasets' save_to_disk"
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")

# A raw row: (number, value, bytes as stored, problem or None, the error behind the problem)
Row = tuple[int, object, int, "str | None", "BaseException | None"]


def form_of(path, expected: str) -> str:
    """'jsonl' | 'parquet' | 'arrow' | 'dataset'; a UserError naming the path and the accepted forms."""
    p = Path(path)
    if p.is_dir():
        if (p / "state.json").is_file():
            return "dataset"
        splits = p / "dataset_dict.json"
        if splits.is_file():
            names = json.loads(splits.read_text()).get("splits") or []
            raise UserError(
                f"{path}: a folder of dataset splits ({', '.join(names)}); give one split's folder, "
                f"e.g. {p / (names[0] if names else 'train')}"
            )
        raise UserError(f"{path}: a folder without a state.json; expected {FORMS}, holding {expected}")
    if not p.is_file():
        raise UserError(f"{path}: no such file or folder; expected {FORMS}, holding {expected}")
    name = p.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    for suffix in ("parquet", "arrow"):
        if name.endswith("." + suffix):
            return suffix
    raise UserError(f"{path}: not a form of records this reads; expected {FORMS}, holding {expected}")


def rows(path, form: str, expected: str, bad_json: str) -> Iterator[Row]:
    if form == "jsonl":
        return jsonl_rows(path, expected, bad_json)
    return _columnar_rows(path, form)


def jsonl_rows(path, expected: str, bad_json: str) -> Iterator[Row]:
    """The values of a JSONL file's non-blank lines, or the problem of each bad one."""
    for n, line in _lines(path, expected):
        size = len(line)
        if n == 1 and line.startswith(codecs.BOM_UTF8):
            line = line[len(codecs.BOM_UTF8) :]
        if not line.strip():
            continue
        try:
            text = line.rstrip(b"\r\n").decode("utf-8")  # without its end: an error's column is on this line
        except UnicodeDecodeError as e:
            where = f"{e.reason} at byte {e.start + 1} of the line"
            yield n, None, size, f"not UTF-8 ({where}); expected UTF-8 encoded JSON, {expected}", e
            continue
        try:
            yield n, json.loads(text), size, None, None
        except json.JSONDecodeError as e:
            yield n, None, size, f"{bad_json} ({e.msg} at column {e.colno}); expected {expected}", e
        except (ValueError, RecursionError) as e:  # e.g. an integer of too many digits, or nesting too deep
            yield n, None, size, f"{bad_json} ({e}); expected {expected}", e


def _lines(path, expected: str) -> Iterator[tuple[int, bytes]]:
    """(line number, raw bytes) of every line; UserError for a missing file or damaged gzip."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{path}: no such file; expected a JSONL file, {expected}")
    if not p.name.endswith(".gz"):
        with open(p, "rb") as f:
            yield from enumerate(f, 1)
        return
    try:
        with gzip.open(p, "rb") as f:
            yield from enumerate(f, 1)
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise UserError(
            f"{path}: not a readable gzip file ({e}); the file is damaged or not gzip: write it "
            "again (a name ending in .gz is read through gzip)"
        ) from None


def _columnar_rows(path, form: str) -> Iterator[Row]:
    pa = _pyarrow(path)
    files = dataset_files(path) if form == "dataset" else [Path(path)]
    n = 0
    for file in files:
        try:
            batches = _parquet_batches(file) if form == "parquet" else _arrow_batches(pa, file)
            for batch in batches:
                for row in batch.to_pylist():
                    n += 1
                    yield n, _without_nulls(row), 0, None, None
        except (pa.ArrowException, OSError) as e:
            what = "Parquet" if form == "parquet" else "Arrow IPC"
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"{file}: not a readable {what} file ({first}); write it again") from None


def dataset_files(folder) -> list[Path]:
    """The arrow files of a save_to_disk folder, in the order its state.json lists them."""
    folder = Path(folder)
    try:
        listed = json.loads((folder / "state.json").read_text()).get("_data_files")
        names = [entry["filename"] for entry in listed]
    except (ValueError, TypeError, KeyError, AttributeError):
        raise UserError(
            f"{folder / 'state.json'}: not the state.json datasets' save_to_disk writes "
            "(expected '_data_files': [{'filename': ...}, ...])"
        ) from None
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise UserError(f"{folder}: state.json lists {', '.join(missing)}, which the folder does not hold")
    return [folder / name for name in names]


def _pyarrow(path):
    try:
        import pyarrow
    except ImportError:
        raise UserError(f"{path}: reading Parquet or Arrow needs pyarrow (pip install pyarrow)") from None
    return pyarrow


def _parquet_batches(file: Path):
    import pyarrow.parquet as pq

    with pq.ParquetFile(file) as f:
        yield from f.iter_batches()


def _arrow_batches(pa, file: Path):
    with pa.memory_map(str(file)) as source:
        try:
            reader = pa.ipc.open_file(source)
        except pa.ArrowInvalid:  # not the file format: the stream format (what save_to_disk writes)
            source.seek(0)
            reader = pa.ipc.open_stream(source)
            yield from reader
            return
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)


def _without_nulls(value):
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value
