import random
import sysconfig
from pathlib import Path

import pytest

from lm.data.corpus import resolve_corpus, split_files, stdlib_files
from lm.errors import UserError


def test_stdlib_files():
    files = stdlib_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    assert len(files) > 100
    assert all(p.suffix == ".py" for p in files)
    rel = [p.relative_to(root).as_posix() for p in files]
    assert rel == sorted(rel)
    assert not any("site-packages" in r or "dist-packages" in r for r in rel)
    assert resolve_corpus("stdlib") == (root, files)


def test_stdlib_split_deterministic_disjoint():
    root, files = resolve_corpus("stdlib")
    train, heldout = split_files(root, files, 0.1)
    shuffled = files[:]
    random.Random(0).shuffle(shuffled)
    assert split_files(root, shuffled, 0.1) == (train, heldout)
    assert not set(train) & set(heldout)
    assert set(train) | set(heldout) == set(files)
    assert 0.05 < len(heldout) / len(files) < 0.15
    # Membership depends only on each path: dropping files moves nobody across the split.
    train2, heldout2 = split_files(root, files[::2], 0.1)
    assert set(heldout2) == set(heldout) & set(files[::2])


def _write(root: Path, rel: str, data: bytes | str):
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data.encode() if isinstance(data, str) else data)
    return p


def test_resolve_directory_and_glob(tmp_path):
    a = _write(tmp_path, "b/a.txt", "alpha")
    b = _write(tmp_path, "a.md", "beta")
    c = _write(tmp_path, "z/deep/c.py", "gamma")
    _write(tmp_path, ".git/config", "hidden")
    _write(tmp_path, ".hidden.txt", "hidden")
    _write(tmp_path, "img.bin", b"\x89PNG\x00\x01")
    root, files = resolve_corpus(str(tmp_path))
    assert root == tmp_path and files == [b, a, c]
    root, files = resolve_corpus(str(tmp_path / "**" / "*.txt"))
    assert root == tmp_path and files == [a]


def test_split_small(tmp_path):
    files = [_write(tmp_path, f"{i}.txt", "x") for i in range(2)]
    train, heldout = split_files(tmp_path, files, 0.01)
    assert len(train) == 1 and len(heldout) == 1
    with pytest.raises(UserError, match="at least 2"):
        split_files(tmp_path, files[:1], 0.1)
    with pytest.raises(UserError, match="heldout_fraction"):
        split_files(tmp_path, files, 1.0)


def test_missing_and_empty(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(UserError, match=f"'{missing}' does not exist"):
        resolve_corpus(str(missing))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match=str(empty)):
        resolve_corpus(str(empty))
    _write(empty, "a.txt", "")
    with pytest.raises(UserError, match=f"empty.*'{empty}'|'{empty}'.*empty"):
        resolve_corpus(str(empty))
    with pytest.raises(UserError, match="no text files"):
        resolve_corpus(str(tmp_path / "*.nothing"))


def test_jsonl_files_are_documents_not_binary(tmp_path):
    import gzip

    from lm.data.corpus import iter_documents

    _write(tmp_path, "a.jsonl.gz", gzip.compress(b'{"text": "one"}\n\n{"text": "two"}\n'))
    _write(tmp_path, "b.txt", b"plain")
    root, files = resolve_corpus(str(tmp_path))
    assert [p.name for p in files] == ["a.jsonl.gz", "b.txt"]
    assert list(iter_documents(files[0])) == [("one", f"{files[0]}:1"), ("two", f"{files[0]}:3")]
    assert list(iter_documents(files[1])) == [(b"plain", str(files[1]))]
    _write(tmp_path, "c.jsonl.gz", b"not gzip at all")
    with pytest.raises(UserError, match="c.jsonl.gz: not a readable gzip file"):
        list(iter_documents(tmp_path / "c.jsonl.gz"))


def test_curated_directory_gives_its_shards_not_its_report(tmp_path):
    import gzip

    for i in range(2):
        with gzip.open(tmp_path / f"part-{i:05d}.jsonl.gz", "wt") as f:
            f.write('{"text": "kept"}\n')
    (tmp_path / "report.json").write_text('{"kept": {"docs": 2}}')
    (tmp_path / "notes.txt").write_text("not a curated document")
    root, files = resolve_corpus(str(tmp_path))
    assert root == tmp_path and [p.name for p in files] == ["part-00000.jsonl.gz", "part-00001.jsonl.gz"]
    (tmp_path / "report.json").unlink()  # an ordinary directory: every text file
    assert {p.name for p in resolve_corpus(str(tmp_path))[1]} >= {"notes.txt"}
