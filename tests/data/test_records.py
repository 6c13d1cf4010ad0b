"""lm.data.records on JSONL: numbered lines, FILE:LINE errors, skip modes, gzip (the JSONL form of the one reader)."""

import gzip
import pickle
import re

import pytest

from lm.data import jsonl
from lm.data.records import ONE_OBJECT, BadRecord, iter_jsonl, iter_records, read_records
from lm.errors import UserError


def write(path, data: bytes):
    path.write_bytes(data)
    return path


def test_values_with_line_numbers_blank_lines_skipped_but_counted(tmp_path):
    path = write(tmp_path / "a.jsonl", b'{"a": 1}\n\n   \n[1, 2]\r\n"s"\n3')
    assert list(iter_records(path)) == [(1, {"a": 1}), (4, [1, 2]), (5, "s"), (6, 3)]
    assert read_records(path, limit=2) == [(1, {"a": 1}), (4, [1, 2])]
    sizes = [size for _, _, size in iter_jsonl(path, with_size=True)]
    assert sizes == [9, 8, 4, 1]


def test_byte_order_mark_at_the_start_is_allowed(tmp_path):
    path = write(tmp_path / "bom.jsonl", b'\xef\xbb\xbf{"a": 1}\n{"b": 2}\n')
    assert [v for _, v in iter_records(path)] == [{"a": 1}, {"b": 2}]


def test_malformed_line_names_file_and_line(tmp_path):
    path = write(tmp_path / "bad.jsonl", b'{"a": 1}\n\n{"a": \n')
    with pytest.raises(
        BadRecord,
        match=rf"^{re.escape(str(path))}:3: malformed JSON \(Expecting value at column 7\); "
        "expected one JSON value per line$",
    ) as e:
        list(iter_records(path))
    assert isinstance(e.value, UserError) and e.value.line == 3 and e.value.where == f"{path}:3"
    with pytest.raises(
        UserError,
        match=r"bad.jsonl:1: not valid JSON \(Extra data at column 10\); expected one "
        "JSON object per line",
    ):
        list(iter_records(write(path, b'{"a": 1} {"b": 2}\n'), expected=ONE_OBJECT, bad_json="not valid JSON"))


def test_invalid_utf8_names_file_and_line(tmp_path):
    path = write(tmp_path / "latin1.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(
        UserError,
        match=r"latin1.jsonl:2: not UTF-8 \(invalid continuation byte at byte 14 of the "
        r"line\); expected UTF-8 encoded JSON, one JSON value per line",
    ):
        list(iter_records(path))


def test_parse_value_error_names_file_and_line_and_keeps_its_cause(tmp_path):
    path = write(tmp_path / "p.jsonl", b'{"n": 1}\n{"n": "two"}\n')

    def number(value):
        if not isinstance(value.get("n"), int):
            raise ValueError(f"'n' is {value['n']!r}; expected an integer")
        return value["n"]

    with pytest.raises(BadRecord, match=r"p.jsonl:2: 'n' is 'two'; expected an integer$") as e:
        read_records(path, number)
    assert isinstance(e.value.cause, ValueError)
    assert read_records(path, number, limit=1) == [(1, 1)]
    other = pickle.loads(pickle.dumps(e.value))  # crosses process boundaries whole
    assert str(other) == str(e.value) and other.where == e.value.where


def test_on_error_skips_counts_or_raises(tmp_path):
    path = write(tmp_path / "mixed.jsonl", b'1\nnope\n\n"x"\n\xff\n4\n')
    seen = []

    def number(v):
        if not isinstance(v, int):
            raise ValueError("not a number")
        return v

    assert list(iter_records(path, number, on_error=seen.append)) == [(1, 1), (6, 4)]
    assert [(e.line, type(e.cause).__name__) for e in seen] == [
        (2, "JSONDecodeError"),
        (4, "ValueError"),
        (5, "UnicodeDecodeError"),
    ]

    def stop(error):
        raise UserError(f"{error} (skip mode skips such lines)")

    with pytest.raises(UserError, match=r"mixed.jsonl:2: malformed JSON .* \(skip mode skips such lines\)$"):
        list(iter_records(path, number, on_error=stop))


def test_empty_and_missing_files(tmp_path):
    empty = write(tmp_path / "empty.jsonl", b"\n  \n")
    with pytest.raises(
        UserError,
        match=r"empty.jsonl: no preference pairs \(no non-blank line or row\); "
        r"expected one JSON object per line \(or one row of a table\)",
    ):
        read_records(empty, what="preference pairs", expected=ONE_OBJECT)
    assert list(iter_records(empty)) == []
    with pytest.raises(UserError, match="nope.jsonl: no such file or folder; expected a .jsonl or .jsonl.gz file"):
        list(iter_records(tmp_path / "nope.jsonl"))
    with pytest.raises(UserError, match="a folder without a state.json; expected a .jsonl"):
        read_records(tmp_path)  # a folder that datasets did not write


def test_gzip_is_read_transparently_and_damage_is_one_error(tmp_path):
    path = write(tmp_path / "a.jsonl.gz", gzip.compress(b'{"a": 1}\n\n{"a": 2}\n'))
    assert read_records(path) == [(1, {"a": 1}), (3, {"a": 2})]
    bad = write(tmp_path / "b.jsonl.gz", gzip.compress(b'{"a": 1}\n{oops\n'))
    with pytest.raises(BadRecord, match="b.jsonl.gz:2: malformed JSON"):
        read_records(bad)
    with pytest.raises(UserError, match="c.jsonl.gz: not a readable gzip file"):
        read_records(write(tmp_path / "c.jsonl.gz", b"not gzip at all"))
    truncated = write(tmp_path / "d.jsonl.gz", gzip.compress(b'{"a": 1}\n' * 1000)[:-20])
    with pytest.raises(UserError, match="d.jsonl.gz: not a readable gzip file"):
        read_records(truncated)


def test_stopping_early_reads_no_further(tmp_path):
    path = write(tmp_path / "a.jsonl", b"1\n2\n{broken\n")
    assert read_records(path, limit=2) == [(1, 1), (2, 2)]  # the broken line is never read


def test_jsonl_by_contract_whatever_the_name(tmp_path):
    """lm.data.jsonl keeps the reader of files that are JSONL by contract (metrics, task files)."""
    path = write(tmp_path / "metrics.log", b'{"a": 1}\n')
    assert list(jsonl.iter_jsonl(path)) == [(1, {"a": 1})] and jsonl.BadLine is BadRecord
    with pytest.raises(UserError, match="metrics.log: not a form of records this reads"):
        list(iter_records(path))
