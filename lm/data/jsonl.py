"""JSONL files of records: the one reader, with FILE:LINE errors.

A JSONL file holds one JSON value per line, UTF-8 encoded (a byte-order mark at its start is
allowed); lines end with "\\n" ("\\r\\n" too). Blank lines are skipped but counted, so line
numbers are those an editor shows. A name ending in ".gz" is read through gzip.

`iter_jsonl` yields (line number, value), or (line number, parse(value)) given `parse`. A line
that is not UTF-8, is not one JSON value, or whose `parse` raises ValueError is a `BadLine`,
a UserError saying "FILE:LINE: what is wrong; expected ...". It is raised, or with `on_error`
handed to it: on_error may raise it (or another error) or return, which skips the line (the
skip-and-count modes of the data readers).

`read_jsonl` reads the records of a whole file (or its first `limit`) into a list; a file
without any is an error naming the file and what it should hold.
"""

from __future__ import annotations

import codecs
import gzip
import itertools
import json
import zlib
from pathlib import Path
from typing import Callable, Iterator

from lm.errors import UserError

ONE_VALUE = "one JSON value per line"
ONE_OBJECT = "one JSON object per line"


class BadLine(UserError):
    """A line that could not be read: `path:line: problem`. `cause` is the error behind it
    (json.JSONDecodeError, UnicodeDecodeError, or the ValueError `parse` raised)."""

    def __init__(self, path, line: int, problem: str, cause: BaseException | None = None):
        super().__init__(f"{path}:{line}: {problem}")
        self.path, self.line, self.problem, self.cause = str(path), line, problem, cause

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    def __reduce__(self):  # picklable across processes (the cause is left behind)
        return BadLine, (self.path, self.line, self.problem)


def iter_jsonl(
    path,
    parse: Callable[[object], object] | None = None,
    *,
    expected: str = ONE_VALUE,
    on_error: Callable[[BadLine], None] | None = None,
    with_size: bool = False,
    bad_json: str = "malformed JSON",
) -> Iterator[tuple]:
    """(line number, value) of each non-blank line, value = parse(the JSON value) if given.

    expected: what a line should hold, ending every error message ("one JSON object per line",
      'one {"text": ...} object per line').
    on_error: called with the BadLine of a bad line instead of raising it; the line is skipped
      if it returns.
    with_size: yield (line number, value, bytes of the line as stored, newline included).
    bad_json: how a line that is not JSON is named in its message.
    A missing file, or a .gz file that is not readable gzip, is a UserError naming the file.
    """
    for n, line in _lines(path, expected):
        size = len(line)
        if n == 1 and line.startswith(codecs.BOM_UTF8):
            line = line[len(codecs.BOM_UTF8) :]
        if not line.strip():
            continue
        error = None
        try:
            text = line.rstrip(b"\r\n").decode("utf-8")  # without its end: an error's column is on this line
        except UnicodeDecodeError as e:
            error = BadLine(
                path,
                n,
                f"not UTF-8 ({e.reason} at byte {e.start + 1} of the line); expected UTF-8 encoded JSON, {expected}",
                e,
            )
        else:
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                error = BadLine(path, n, f"{bad_json} ({e.msg} at column {e.colno}); expected {expected}", e)
            except (ValueError, RecursionError) as e:  # e.g. an integer of too many digits, or nesting too deep
                error = BadLine(path, n, f"{bad_json} ({e}); expected {expected}", e)
            else:
                if parse is not None:
                    try:
                        value = parse(value)
                    except ValueError as e:
                        error = BadLine(path, n, str(e), e)
        if error is not None:
            if on_error is None:
                raise error
            on_error(error)
            continue
        yield (n, value, size) if with_size else (n, value)


def read_jsonl(
    path,
    parse: Callable[[object], object] | None = None,
    *,
    what: str = "records",
    expected: str = ONE_VALUE,
    limit: int = 0,
    bad_json: str = "malformed JSON",
) -> list[tuple[int, object]]:
    """[(line number, value)] of the first `limit` (0 = all) records, as `iter_jsonl`; a file
    with none is a UserError naming it, `what` it should hold (a plural noun) and `expected`."""
    out = list(itertools.islice(iter_jsonl(path, parse, expected=expected, bad_json=bad_json), limit or None))
    if not out:
        raise UserError(f"{path}: no {what} (the file has no non-blank line); expected {expected}")
    return out


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
