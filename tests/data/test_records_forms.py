"""lm.data.records on Parquet, Arrow files and streams, and datasets' save_to_disk folders: the same
rows as JSONL (nulls as absent keys), rows numbered across a folder in FILE:ROW errors, skip modes,
and one line for a path of no accepted form."""

import json
import re

import pytest

from lm.data.records import ONE_OBJECT, BadRecord, fingerprint, iter_records, read_records
from lm.errors import UserError
from tests.data.forms import FORMS, write

pytest.importorskip("pyarrow")
RECORDS = [
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}], "id": 1},
    {
        "messages": [
            {"role": "user", "content": "Think"},
            {"role": "assistant", "content": "42", "reasoning_content": "6 * 7"},
        ]
    },
    {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}], "id": 3},
    {"messages": [{"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}], "id": 4},
    {"messages": [{"role": "user", "content": "d"}, {"role": "assistant", "content": "e"}], "id": 5},
]


def number(record):
    if record.get("id") is None:
        raise ValueError("no 'id'; expected an integer")
    return record["id"]


@pytest.mark.parametrize("form", FORMS)
def test_every_form_gives_the_rows_of_jsonl(tmp_path, form):
    path = write(RECORDS, tmp_path, form)
    assert list(iter_records(path)) == list(enumerate(RECORDS, 1))
    assert read_records(path, limit=2) == [(1, RECORDS[0]), (2, RECORDS[1])]


@pytest.mark.parametrize("form", ["parquet", "folder", "datasets"])
def test_a_bad_row_names_file_and_row(tmp_path, form):
    path = write(RECORDS, tmp_path, form)
    with pytest.raises(BadRecord, match=rf"^{re.escape(str(path))}:2: no 'id'; expected an integer$") as e:
        read_records(path, number)
    assert e.value.row == 2 and e.value.where == f"{path}:2"
    seen = []
    assert [n for n, _ in iter_records(path, number, on_error=seen.append)] == [1, 3, 4, 5]  # 4, 5: second file
    assert [error.where for error in seen] == [f"{path}:2"]


def test_a_folder_reads_its_files_in_the_order_state_json_lists_them(tmp_path):
    path = write(RECORDS, tmp_path, "folder")
    state = json.loads((path / "state.json").read_text())
    state["_data_files"].reverse()
    (path / "state.json").write_text(json.dumps(state))
    assert [r.get("id") for _, r in iter_records(path)] == [4, 5, 1, None, 3]
    state["_data_files"].append({"filename": "data-00009-of-00002.arrow"})
    (path / "state.json").write_text(json.dumps(state))
    with pytest.raises(UserError, match="state.json lists data-00009-of-00002.arrow, which the folder does not hold"):
        list(iter_records(path))


def test_paths_of_no_accepted_form_are_one_line(tmp_path):
    forms = r"expected a .jsonl or .jsonl.gz file, a .parquet file, an .arrow file, or a folder written by datasets"
    csv = tmp_path / "data.csv"
    csv.write_text("a,b\n")
    for path, problem in (
        (csv, "not a form of records this reads"),
        (tmp_path / "nope.parquet", "no such file or folder"),
        (tmp_path, "a folder without a state.json"),
    ):
        with pytest.raises(
            UserError, match=rf"^{re.escape(str(path))}: {problem}; {forms}.*holding .*row of a table\)$"
        ):
            read_records(path, expected=ONE_OBJECT)
    splits = tmp_path / "dd"
    splits.mkdir()
    (splits / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    with pytest.raises(
        UserError, match=rf"a folder of dataset splits \(train, test\); .* e.g. {re.escape(str(splits))}"
    ):
        read_records(splits)


def test_damaged_files_are_one_error(tmp_path):
    for name, what in (("bad.parquet", "Parquet"), ("bad.arrow", "Arrow IPC")):
        path = tmp_path / name
        path.write_bytes(b"not a table at all")
        with pytest.raises(
            UserError, match=rf"^{re.escape(str(path))}: not a readable {what} file \(.*\); write it again$"
        ):
            read_records(path)


def test_an_empty_table_has_no_records(tmp_path):
    path = write([{"id": 1}], tmp_path, "parquet")
    assert read_records(path) == [(1, {"id": 1})]
    import pyarrow as pa
    import pyarrow.parquet as pq

    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"id": pa.array([], pa.int64())}), empty)
    with pytest.raises(UserError, match=r"empty.parquet: no pairs \(no non-blank line or row\)"):
        read_records(empty, what="pairs")


def test_fingerprints_follow_content_not_place(tmp_path):
    a, b = write(RECORDS, tmp_path / "a", "folder"), write(RECORDS, tmp_path / "b", "folder")
    assert fingerprint(a) == fingerprint(b)
    c = write(RECORDS[::-1], tmp_path / "c", "folder")
    assert fingerprint(c) != fingerprint(a)
