"""Records of data files: the one reader, whatever the form, with FILE:ROW errors.

A records path is a JSONL file (.jsonl, .jsonl.gz), a Parquet file, an Arrow file, or a folder
written by Hugging Face datasets' `save_to_disk` (lm.data.formats reads each). Rows are numbered
from 1 within the file or folder (for JSONL, the line number); Parquet and Arrow rows are dicts.

`iter_records` yields (row, value), or (row, parse(value)) given `parse`. A row that cannot be read
(JSONL: not UTF-8, not one JSON value) or whose `parse` raises ValueError is a `BadRecord`, a
UserError saying "FILE:ROW: what is wrong; expected ...". It is raised, or with `on_error` handed to
it: on_error may raise it (or another error) or return, which skips the row (the skip-and-count
modes of the data readers).

`read_records` reads the records of a whole path (or its first `limit`) into a list; a path without
any is an error naming it and what it should hold. `fingerprint` names a path's content (cache keys).
"""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path
from typing import Callable, Iterator

from lm.data import formats
from lm.errors import UserError

ONE_VALUE = "one JSON value per line"
ONE_OBJECT = "one JSON object per line (or one row of a table)"
FORMS = formats.FORMS


class BadRecord(UserError):
    """A row that could not be read: `path:row: problem`. `cause` is the error behind it
    (json.JSONDecodeError, UnicodeDecodeError, or the ValueError `parse` raised)."""

    def __init__(self, path, row: int, problem: str, cause: BaseException | None = None):
        super().__init__(f"{path}:{row}: {problem}")
        self.path, self.row, self.problem, self.cause = str(path), row, problem, cause

    @property
    def line(self) -> int:  # a JSONL row is its line
        return self.row

    @property
    def where(self) -> str:
        return f"{self.path}:{self.row}"

    def __reduce__(self):  # picklable across processes (the cause is left behind)
        return BadRecord, (self.path, self.row, self.problem)


def records_form(path, what: str = "records") -> str:
    """The form of a records path ('jsonl', 'parquet', 'arrow', 'dataset'), or one UserError line
    naming the path and the accepted forms; `what` names what it should hold."""
    return formats.form_of(path, what)


def iter_records(
    path,
    parse: Callable[[object], object] | None = None,
    *,
    expected: str = ONE_VALUE,
    on_error: Callable[[BadRecord], None] | None = None,
    bad_json: str = "malformed JSON",
) -> Iterator[tuple[int, object]]:
    """(row number, value) of each record, value = parse(the record) if given.

    expected: what a record should be, ending every error message ("one JSON object per line").
    on_error: called with the BadRecord of a bad row instead of raising it; the row is skipped if it returns.
    bad_json: how a JSONL line that is not JSON is named in its message.
    A path of no accepted form, or a file that is not readable as its form, is a UserError naming it.
    """
    form = formats.form_of(path, expected)
    yield from _parsed(path, formats.rows(path, form, expected, bad_json), parse, on_error, with_size=False)


def iter_jsonl(
    path,
    parse: Callable[[object], object] | None = None,
    *,
    expected: str = ONE_VALUE,
    on_error: Callable[[BadRecord], None] | None = None,
    with_size: bool = False,
    bad_json: str = "malformed JSON",
) -> Iterator[tuple]:
    """As `iter_records` for a file read as JSONL whatever its name (files that are JSONL by
    contract, e.g. metrics); with_size: (line number, value, bytes of the line, newline included)."""
    yield from _parsed(path, formats.jsonl_rows(path, expected, bad_json), parse, on_error, with_size)


def read_records(
    path,
    parse: Callable[[object], object] | None = None,
    *,
    what: str = "records",
    expected: str = ONE_VALUE,
    limit: int = 0,
    bad_json: str = "malformed JSON",
) -> list[tuple[int, object]]:
    """[(row number, value)] of the first `limit` (0 = all) records, as `iter_records`; a path
    with none is a UserError naming it, `what` it should hold (a plural noun) and `expected`."""
    out = list(itertools.islice(iter_records(path, parse, expected=expected, bad_json=bad_json), limit or None))
    if not out:
        raise UserError(f"{path}: no {what} (no non-blank line or row); expected {expected}")
    return out


def fingerprint(path) -> str:
    """sha256 of a file's bytes; of a folder, of its files' names and bytes in name order."""
    p = Path(path)
    if p.is_file():
        with open(p, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    digest = hashlib.sha256()
    for file in sorted(q for q in p.rglob("*") if q.is_file()):
        digest.update(file.relative_to(p).as_posix().encode() + b"\0")
        with open(file, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()


def _parsed(path, rows: Iterator[formats.Row], parse, on_error, with_size: bool) -> Iterator[tuple]:
    for n, value, size, problem, cause in rows:
        if problem is None and parse is not None:
            try:
                value = parse(value)
            except ValueError as e:
                problem, cause = str(e), e
        if problem is not None:
            error = BadRecord(path, n, problem, cause)
            if on_error is None:
                raise error
            on_error(error)
            continue
        yield (n, value, size) if with_size else (n, value)
