"""Curation parts without a full pipeline: readers per format, PII patterns, offline language id,
config checks; plus the CLI verb, multi-process runs and recovery after a failed run."""

import gzip
import json
import random

import pytest

pytest.importorskip("datatrove")

from lm import cli  # noqa: E402
from lm.config import load_config, with_values  # noqa: E402
from lm.data.curate import REPORT, curate  # noqa: E402
from lm.data.curate.blocks import PIIRedactor, ShippedFT176LID  # noqa: E402
from lm.data.curate.read import InputFile, discover, read_records  # noqa: E402
from lm.data.curate.settings import check_config  # noqa: E402
from lm.errors import UserError  # noqa: E402


def _records(path, key="text"):
    return list(read_records(InputFile(str(path), path.name), key))


def test_jsonl_reader_plain_gzip_zstd_give_the_same_records(tmp_path):
    import zstandard

    lines = b'{"text": "one", "id": 7}\n\n{"text": "caf\\u00e9"}\n'
    (tmp_path / "a.jsonl").write_bytes(lines)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(lines))
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    got = [
        [(r.text, r.record_id, r.nbytes, r.problem) for r in _records(tmp_path / n)]
        for n in ("a.jsonl", "a.jsonl.gz", "a.jsonl.zst")
    ]
    assert got[0] == [("one", "7", 3, ""), ("café", "a.jsonl:3", 5, "")]  # blank line 2 skipped
    assert got[1] == [("one", "7", 3, ""), ("café", "a.jsonl.gz:3", 5, "")]
    assert [g[:1] + g[2:] for g in got[2]] == [("one", 3, ""), ("café", 5, "")]


def test_jsonl_reader_reports_each_bad_line(tmp_path):
    p = tmp_path / "b.jsonl"
    p.write_bytes(b'[1, 2]\n{"text": 3}\n{"text": "ok"}\n\xff\xfe\n{"te\n')
    problems = [(r.where.rsplit(":", 1)[1], r.problem.split(" (")[0].split(";")[0]) for r in _records(p)]
    assert problems == [
        ("1", "no string field 'text'"),
        ("2", "no string field 'text'"),
        ("3", ""),
        ("4", "invalid UTF-8"),
        ("5", "not valid JSON"),
    ]


def test_truncated_gzip_is_a_bad_record_not_a_crash(tmp_path):
    p = tmp_path / "t.jsonl.gz"
    p.write_bytes(gzip.compress(b'{"text": "a"}\n' * 100)[:-20])
    recs = _records(p)
    assert recs[-1].problem.startswith("unreadable compressed data") and all(r.text == "a" for r in recs[:-1])


def test_parquet_reader_reads_text_column_and_flags_nulls_and_missing_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["first", None, "third"], "n": [1, 2, 3]}), tmp_path / "d.parquet")
    recs = _records(tmp_path / "d.parquet")
    assert [(r.text, r.record_id, bool(r.problem)) for r in recs] == [
        ("first", "d.parquet:1", False),
        ("", "", True),
        ("third", "d.parquet:3", False),
    ]
    assert "no column 'body'" in _records(tmp_path / "d.parquet", key="body")[0].problem


def test_discover_keeps_data_files_skips_binary_and_hidden(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.py").write_text("x = 1\n")
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(b'{"text": "t"}\n'))
    (tmp_path / "c.bin").write_bytes(b"\0\1\2")
    (tmp_path / ".hidden.txt").write_text("secret")
    files, skipped = discover([str(tmp_path)])
    assert [f.rel for f in files] == ["b.jsonl.gz", "sub/a.py"] and skipped == [str(tmp_path / "c.bin")]
    files, _ = discover([str(tmp_path / "**" / "*.py")])
    assert [f.rel for f in files] == ["sub/a.py"]
    with pytest.raises(UserError, match="does not exist"):
        discover([str(tmp_path / "nope")])


def test_stdlib_input_is_the_standard_library():
    files, skipped = discover(["stdlib"])
    assert len(files) > 500 and not skipped and any(f.rel == "json/decoder.py" for f in files)


@pytest.mark.parametrize(
    "text, redacted",
    [
        ("mail a.b-c@mail.example.co.uk now", "a.b-c@mail.example.co.uk"),
        ("dns 1.1.1.1 up", "1.1.1.1"),
        ("call 555-123-4567.", "555-123-4567"),
        ("call (555) 123 4567", "(555) 123 4567"),
        ("call +1 555.123.4567", "+1 555.123.4567"),
    ],
)
def test_pii_redacts(text, redacted):
    out = PIIRedactor(emails=True, ips=True, phones=True).format(text)
    assert redacted not in out and out.split()[0] == text.split()[0]


@pytest.mark.parametrize(
    "text",
    [
        "x = 12345678901",
        "version 3.11.7",
        "lan 10.0.0.1 and 192.168.0.10",
        "date 2024-01-15",
        "mask 255.255.255.0",
        "isbn 978-3-16-148410-0",
        "row 6 12 24 48 96 192",
        "hex 0031 2044 0034",
        "n 123 456 789",
        "mixed 555-123.4567",
    ],
)
def test_pii_leaves_numbers_that_are_not_personal(text):
    assert PIIRedactor(emails=True, ips=True, phones=True).format(text) == text


def test_language_id_works_offline_from_the_shipped_model():
    from datatrove.data import Document

    lid = ShippedFT176LID(["en"])
    (lang, score), pairs = lid.predict(Document(text="The weather was lovely and we walked to the harbour.", id="e"))
    assert lang == "en" and score > 0.9 and pairs == {"en": score}
    (lang, _), pairs = lid.predict(Document(text="Nous avons marché jusqu'au port sous un beau soleil.", id="f"))
    assert lang == "fr" and pairs["en"] < 0.1


def test_language_id_accepts_either_fasttext_backend():
    """fasttext-predict returns plain floats where fasttext-numpy2-wheel returns numpy arrays."""
    import numpy as np
    from datatrove.data import Document

    class Backend:
        def __init__(self, scores):
            self.scores = scores

        def predict(self, text, k):
            return ("__label__fr", "__label__en"), self.scores

    for scores in ((0.7, 0.2), np.array([0.7, 0.2])):
        lid = ShippedFT176LID(["en", "de"])
        lid._model = Backend(scores)
        assert lid.predict(Document(text="x", id="x")) == (("fr", 0.7), {"en": 0.2, "de": 0.0})


def test_config_checks_name_the_key():
    c = with_values(load_config(None), {"curate.gopher_repetition.top_n_grams": ("2-0.2",)}).curate
    with pytest.raises(UserError, match="curate.gopher_repetition.top_n_grams"):
        check_config(c)
    with pytest.raises(UserError, match="curate.on_bad_record"):
        load_config(None, ["curate.on_bad_record=ignore"])
    with pytest.raises(UserError, match="unknown config key 'curate.near_dedup.band'"):
        load_config(None, ["curate.near_dedup.band=3"])


def _docs(root, n=6):
    """n documents with unrelated random words: no two are near duplicates."""
    root.mkdir(exist_ok=True)
    words = "river mountain forest village ocean people history music garden winter storm island".split()
    for i in range(n):
        rng = random.Random(i)
        (root / f"d{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(300)) + ".")


def _only_dedup(*extra):
    return load_config(
        None,
        [f"curate.{s}.enabled=false" for s in ("language", "gopher_repetition", "gopher_quality", "c4", "fineweb")]
        + list(extra),
    )


def test_cli_curate_writes_shards_and_report(tmp_path, capsys):
    _docs(tmp_path / "in")
    (tmp_path / "in" / "copy.txt").write_text((tmp_path / "in" / "d0.txt").read_text())
    args = [
        "curate",
        "--input",
        str(tmp_path / "in" / "*.txt"),
        "--out",
        str(tmp_path / "out"),
        "--config",
        "configs/tiny.py",
        "--no-progress",
        "--config.curate.language.enabled=false",
        "--config.curate.gopher_quality.enabled=false",
        "--config.curate.c4.enabled=false",
        "--config.curate.fineweb.enabled=false",
        "--config.curate.gopher_repetition.enabled=false",
        "--config.curate.on_bad_record=error",
    ]
    assert cli.main(args) == 0
    assert "kept 6 of 7 documents" in capsys.readouterr().out
    report = json.loads((tmp_path / "out" / REPORT).read_text())
    assert report["stages"]["exact_dedup"]["reasons"]["exact_duplicate"]["docs"] == 1
    (tmp_path / "in" / "bad.jsonl").write_text('{"text": "fine"}\nnope\n')
    args[2] = str(tmp_path / "in")
    assert cli.main(args) == 2
    assert "bad.jsonl:2: not valid JSON" in capsys.readouterr().err


def test_tiny_config_skips_malformed_jsonl_and_names_each_line(tmp_path, capsys):
    """configs/tiny.py sets curate.on_bad_record=skip (a few stdlib files are not UTF-8): a malformed
    line is then counted and named, FILE:LINE, in the table and report.json; =error stops at it."""
    _docs(tmp_path / "in", n=2)
    bad = tmp_path / "in" / "bad.jsonl"
    bad.write_text('{"text": "fine"}\nnope\n{"body": 1}\n')
    args = [
        "curate",
        "--input",
        str(tmp_path / "in"),
        "--out",
        str(tmp_path / "out"),
        "--config",
        "configs/tiny.py",
        "--no-progress",
        "--config.curate.language.enabled=false",
    ]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "skipped 2 unreadable record(s) (curate.on_bad_record=skip; =error stops at the first):" in out
    assert f"  {bad}:2: not valid JSON" in out and f"  {bad}:3: no string field 'text'" in out
    assert [line.split(": ", 1)[0] for line in json.loads((tmp_path / "out" / REPORT).read_text())["bad_records"]] == [
        f"{bad}:2",
        f"{bad}:3",
    ]
    assert cli.main(args + ["--config.curate.on_bad_record=error"]) == 2
    assert f"{bad}:2: not valid JSON" in capsys.readouterr().err


def test_duplicates_are_found_across_tasks(tmp_path):
    # files go round-robin (sorted) to 3 tasks: d0 -> 0, d1 -> 1, z_exact (7th) -> 0, z_near (8th) -> 1
    _docs(tmp_path / "in", n=6)
    d0, d1 = (tmp_path / "in" / "d0.txt").read_text(), (tmp_path / "in" / "d1.txt").read_text()
    (tmp_path / "in" / "z_exact.txt").write_text(d1)
    (tmp_path / "in" / "z_near.txt").write_text(d0.replace(" ", " storm ", 1))
    report = curate([str(tmp_path / "in")], tmp_path / "out", _only_dedup("curate.tasks=3").curate, progress=False)
    assert report["tasks"] == 3 and len(report["shards"]) == 3
    assert report["stages"]["exact_dedup"]["reasons"] == {"exact_duplicate": {"docs": 1, "bytes": len(d1)}}
    assert report["stages"]["near_dedup"]["reasons"]["near_duplicate"]["docs"] == 1
    assert report["kept"]["docs"] == 6


@pytest.mark.slow  # a process pool per pass: ~10 s of start-up on two cores
def test_two_workers_give_the_same_documents_as_one(tmp_path):
    _docs(tmp_path / "in", n=8)
    cfg = _only_dedup("curate.tasks=4", "curate.near_dedup.enabled=false").curate
    outs = []
    for workers in (1, 2):
        report = curate([str(tmp_path / "in")], tmp_path / f"out{workers}", cfg, workers=workers, progress=False)
        docs = {}
        for shard in report["shards"]:
            with gzip.open(tmp_path / f"out{workers}" / shard, "rt") as f:
                docs.update((d["id"], d["text"]) for d in map(json.loads, f))
        outs.append(docs)
        assert len(report["shards"]) == 4 and report["kept"]["docs"] == 8
    assert outs[0] == outs[1]


def test_failed_run_leaves_no_output_and_a_fixed_rerun_completes(tmp_path):
    _docs(tmp_path / "in")
    bad = tmp_path / "in" / "z.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "oops"}\n')
    cfg = _only_dedup().curate
    with pytest.raises(UserError, match="z.jsonl:2"):
        curate([str(tmp_path / "in")], tmp_path / "out", cfg, progress=False)
    assert not (tmp_path / "out" / REPORT).exists() and not list((tmp_path / "out").glob("*.jsonl.gz"))
    bad.write_text('{"text": "fine"}\n{"text": "fixed"}\n')
    report = curate([str(tmp_path / "in")], tmp_path / "out", cfg, progress=False)
    assert report["kept"]["docs"] == 8 and not list((tmp_path / "out").glob(".work-*"))
