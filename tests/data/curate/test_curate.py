"""Curation end to end: one pipeline run over planted documents, then what came out and why.

Each planted document fails exactly one stage (checked by the expected drop reasons),
so the run shows every stage dropping its target and keeping the good documents.
"""

import gzip
import json
import random

import pytest

pytest.importorskip("datatrove")

from lm.config import load_config  # noqa: E402
from lm.data.curate import REPORT, curate  # noqa: E402
from lm.data.curate.report import table  # noqa: E402
from lm.errors import UserError  # noqa: E402

_WORDS = (
    "the of and to in that have with be river mountain forest village ocean people history language music "
    "science garden winter summer morning evening teacher student library market harbor bridge castle "
    "painter farmer doctor sailor kitchen window letter journey storm island valley meadow lantern "
    "careful quiet bright ancient gentle famous simple narrow silver golden walked carried noticed "
    "remembered discovered painted visited described followed gathered opened wrote built because "
    "although while after before during between under across toward through often rarely slowly"
).split()


def prose(seed: int, sentences: int = 12) -> str:
    """English prose unique per seed that passes every default filter: two sentences a line."""
    rng = random.Random(seed)
    out = [" ".join(rng.choice(_WORDS) for _ in range(14)).capitalize() + "." for _ in range(sentences)]
    return "\n".join(" ".join(out[i : i + 2]) for i in range(0, len(out), 2))


def short_lines(seed: int) -> str:
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(_WORDS) for _ in range(4)).capitalize() + "." for _ in range(60))


FRENCH = (
    "Le village se trouve au bord de la rivière, entre les montagnes et la forêt. Chaque matin, les habitants "
    "se rendent au marché pour acheter du pain frais et des légumes. Les enfants vont à l'école à pied, "
    "et les anciens se retrouvent sur la place pour discuter de la pluie et du beau temps. En hiver, la neige "
    "recouvre les toits et les chemins deviennent difficiles. Au printemps, les fleurs reviennent dans les "
    "jardins et les oiseaux chantent dès l'aube."
)
SHORT = (
    "The river was quiet this morning. We walked along the bank for an hour. "
    "The birds were singing in the trees. Nobody else was there. It was a good day."
)
REPEATED = prose(20, 4) + "\n" + "\n".join(["We walked along the river and talked about the weather for a while."] * 12)
CURLY = prose(21) + "\nThe setting is written as {value} in the file, as the manual says."
NEAR = prose(1).replace("Walked", "Strolled", 1).split(" ")
NEAR[40] = "lantern"
NEAR = " ".join(NEAR)
PII = (
    prose(22) + "\nWrite to jane.doe@example.net or call (555) 123-4567 or +44 20 7946 0958. "
    "The server at 8.8.8.8 answered, the router at 192.168.1.1 did not, and build 20240115 passed."
)

JSONL = [  # (id, text): in a.jsonl
    ("good0", prose(0)),
    ("good1", prose(1)),
    ("good2", prose(2)),
    ("french", FRENCH),
    ("short", SHORT),
    ("repeated", REPEATED),
    ("curly", CURLY),
    ("short_lines", short_lines(23)),
    ("pii", PII),
    ("banned", prose(24) + "\nA zyzzyva crossed the meadow."),
]
GZ = [("good0_copy", prose(0)), ("good1_near", NEAR), ("good3", prose(3))]  # in b.jsonl.gz
EXPECTED_DROPS = {
    "language": {"language": ["french"]},
    "gopher_repetition": {"dup_line_frac": ["repeated"]},
    "gopher_quality": {"gopher_short_doc": ["short"]},
    "c4": {"curly_bracket": ["curly"]},
    "fineweb": {"short_line_ratio": ["short_lines"]},
    "word_list": {"word_list": ["banned"]},
    "exact_dedup": {"exact_duplicate": ["good0_copy"]},
    "near_dedup": {"near_duplicate": ["good1_near"]},
}


def _nbytes(text: str) -> int:
    return len(text.encode("utf-8"))


def _write_inputs(root):
    root.mkdir()
    lines = [json.dumps({"id": i, "text": t}) for i, t in JSONL]
    lines.insert(3, "{not json")  # a malformed line (line 4), counted and skipped
    (root / "a.jsonl").write_text("\n".join(lines) + "\n")
    with gzip.open(root / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"id": i, "text": t}) + "\n" for i, t in GZ)
    (root / "notes.txt").write_text(prose(4))
    (root / "latin1.txt").write_bytes("caf\xe9 ol\xe9".encode("latin-1"))  # not UTF-8: counted and skipped
    (root / "empty.txt").write_text("")
    (root / "blank.txt").write_text("  \n\n ")
    (root.parent / "words.lst").write_text("zyzzyva\n")  # outside the inputs
    (root / "image.bin").write_bytes(b"\x89PNG\0\0\0")  # binary: skipped and listed


def _cfg(root, **overrides):
    words = ["curate.word_list.enabled=true", f"curate.word_list.path={root.parent / 'words.lst'}"]
    return load_config(None, [f"curate.{k}={v}" for k, v in overrides.items()] + words).curate


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("curate")
    root = base / "in"
    _write_inputs(root)
    cfg = _cfg(root, on_bad_record="skip")
    report = curate([str(root)], base / "out", cfg, workers=1, progress=False)
    kept = {}
    for shard in sorted((base / "out").glob("*.jsonl.gz")):
        with gzip.open(shard, "rt") as f:
            kept.update((d["id"], d) for d in map(json.loads, f))
    return {"report": report, "kept": kept, "out": base / "out", "root": root, "cfg": cfg}


def test_each_stage_drops_its_planted_document_and_keeps_the_good_ones(run):
    stages = run["report"]["stages"]
    for stage, reasons in EXPECTED_DROPS.items():
        got = {r: v["docs"] for r, v in stages[stage]["reasons"].items()}
        assert got == {r: len(ids) for r, ids in reasons.items()}, stage
    assert set(run["kept"]) == {"good0", "good1", "good2", "good3", "pii", "notes.txt"}
    assert run["kept"]["good0"]["text"] == prose(0) and run["kept"]["notes.txt"]["text"] == prose(4)


def test_dropped_bytes_are_those_of_the_dropped_documents(run):
    texts = dict(JSONL + GZ)
    for stage, reasons in EXPECTED_DROPS.items():
        for reason, ids in reasons.items():
            assert run["report"]["stages"][stage]["reasons"][reason]["bytes"] == sum(_nbytes(texts[i]) for i in ids)


def test_report_counts_add_up(run):
    r = run["report"]
    n_docs = len(JSONL) + len(GZ) + 1 + 4  # + notes.txt + latin1, empty, blank files + the bad JSON line
    assert r["in"]["docs"] == n_docs
    assert r["in"]["docs"] == r["kept"]["docs"] + sum(s["dropped_docs"] for s in r["stages"].values())
    assert r["in"]["bytes"] == r["kept"]["bytes"] + sum(s["dropped_bytes"] for s in r["stages"].values())
    assert r["kept"]["docs"] == len(run["kept"])
    assert r["kept"]["bytes_out"] == sum(_nbytes(d["text"]) for d in run["kept"].values())
    assert r["stages"]["read"]["reasons"]["empty"]["docs"] == 2
    assert r["skipped_binary_files"] == [str(run["root"] / "image.bin")]
    saved = json.loads((run["out"] / REPORT).read_text())
    assert saved["in"] == r["in"] and saved["shards"] == r["shards"]


def test_skip_mode_counts_bad_records(run):
    bad = run["report"]["stages"]["read"]["reasons"]["bad_record"]
    assert bad["docs"] == 2  # the line that is not JSON and the latin-1 file
    assert bad["bytes"] == len(b"{not json") + len("caf\xe9 ol\xe9".encode("latin-1"))


def test_skip_mode_names_the_skipped_records_in_the_report_and_its_table(run):
    root = run["root"]
    listed = run["report"]["bad_records"]
    assert [line.split(": ", 1)[0] for line in listed] == [f"{root / 'a.jsonl'}:4", f"{root / 'latin1.txt'}:1"]
    assert "not valid JSON" in listed[0] and "invalid UTF-8 (byte 0xe9)" in listed[1]
    shown = table(run["report"]).splitlines()
    at = shown.index("skipped 2 unreadable record(s) (curate.on_bad_record=skip; =error stops at the first):")
    assert shown[at + 1 : at + 3] == [f"  {line}" for line in listed]


def test_pii_is_redacted(run):
    text = run["kept"]["pii"]["text"]
    for secret in ("jane.doe@example.net", "(555) 123-4567", "+44 20 7946 0958", "8.8.8.8"):
        assert secret not in text
    assert "192.168.1.1" in text and "20240115" in text  # private addresses and plain numbers stay
    assert text.startswith(prose(22))
    assert run["report"]["redacted"] == {"email": 1, "ip": 1, "phone": 2}


def test_language_is_recorded_on_kept_documents(run):
    doc = run["kept"]["good2"]
    assert doc["language"] == "en" and doc["language_score"] > 0.65
    assert doc["source"].endswith("a.jsonl")


def test_rerun_with_same_inputs_and_config_is_a_noop(run):
    shard = run["out"] / run["report"]["shards"][0]
    before = shard.stat().st_mtime_ns
    again = curate([str(run["root"])], run["out"], run["cfg"], workers=1, progress=False)
    assert again == json.loads(json.dumps(run["report"]))
    assert shard.stat().st_mtime_ns == before
    assert not list(run["out"].glob(".work-*"))


def test_malformed_jsonl_line_error_names_file_and_line(tmp_path):
    root = tmp_path / "in"
    root.mkdir()
    (root / "a.jsonl").write_text(json.dumps({"text": prose(0)}) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(UserError, match=rf"{root / 'a.jsonl'}:2: no string field 'text'"):
        curate([str(root)], tmp_path / "out", load_config(None).curate, progress=False)
    # a failed run leaves nothing that looks complete
    assert not (tmp_path / "out" / REPORT).exists() and not list((tmp_path / "out").glob("*.jsonl.gz"))


def test_non_utf8_text_file_error_names_file_and_line(tmp_path):
    root = tmp_path / "in"
    root.mkdir()
    (root / "x.txt").write_bytes(b"fine\nalso fine\ncaf\xe9\n")
    with pytest.raises(UserError, match=rf"{root / 'x.txt'}:3: invalid UTF-8 \(byte 0xe9\)"):
        curate([str(root)], tmp_path / "out", load_config(None).curate, progress=False)
