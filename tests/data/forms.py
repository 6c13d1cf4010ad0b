"""The same records written in every form lm.data.records reads: JSONL, Parquet, an Arrow IPC file,
an Arrow IPC stream, and a folder as datasets' save_to_disk writes it (built with pyarrow: two
data-*.arrow stream files listed in state.json), plus a real save_to_disk folder when datasets is
installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

FORMS = ("jsonl", "parquet", "arrow", "arrow_stream", "folder", "datasets")


def table(records: list[dict]):
    import pyarrow as pa

    keys = list(dict.fromkeys(k for r in records for k in r))  # every column of every record
    return pa.table({k: pa.array([r.get(k) for r in records]) for k in keys})


def write(records: list[dict], directory: Path, form: str) -> Path:
    """`records` written in `form` under `directory`; returns the path to read."""
    pa = pytest.importorskip("pyarrow")
    directory.mkdir(parents=True, exist_ok=True)
    if form == "jsonl":
        path = directory / "data.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return path
    if form == "parquet":
        import pyarrow.parquet as pq

        path = directory / "data.parquet"
        pq.write_table(table(records), path, row_group_size=2)  # several row groups
        return path
    if form in ("arrow", "arrow_stream"):
        path = directory / "data.arrow"
        t = table(records)
        opener = pa.ipc.new_file if form == "arrow" else pa.ipc.new_stream
        with pa.OSFile(str(path), "wb") as sink, opener(sink, t.schema) as writer:
            for batch in t.to_batches(max_chunksize=2):
                writer.write_batch(batch)
        return path
    if form == "folder":
        return _folder(records, directory / "dataset")
    if form == "datasets":
        datasets = pytest.importorskip("datasets")
        path = directory / "saved"
        keys = list(dict.fromkeys(k for r in records for k in r))  # from_list would keep the first row's only
        columns = {k: [r.get(k) for r in records] for k in keys}
        datasets.disable_progress_bars()
        datasets.Dataset.from_dict(columns).save_to_disk(str(path), num_shards=min(2, len(records)))
        return path
    raise ValueError(form)


def _folder(records: list[dict], path: Path) -> Path:
    """Two stream files, named and listed (deliberately out of name order) as save_to_disk lists them."""
    import pyarrow as pa

    path.mkdir(parents=True)
    t = table(records)
    half = (len(records) + 1) // 2
    names = ["data-00001-of-00002.arrow", "data-00000-of-00002.arrow"]
    for name, part in zip(names, (t.slice(0, half), t.slice(half))):
        with pa.OSFile(str(path / name), "wb") as sink, pa.ipc.new_stream(sink, t.schema) as writer:
            writer.write_table(part)
    state = {"_data_files": [{"filename": n} for n in names], "_fingerprint": "0", "_split": None}
    (path / "state.json").write_text(json.dumps(state))
    (path / "dataset_info.json").write_text("{}")
    return path
