"""Find the raw text files of a corpus, split them into train / held-out, read documents.

A corpus spec is 'stdlib' (the running interpreter's standard library: real
English-commented text that is always available offline), a directory, or a
glob pattern. Files are always returned sorted by their path relative to a root,
so every machine sees the same list in the same order.

A plain file is one document. A `.jsonl` or `.jsonl.gz` file (what curation
writes) holds one document per line: a JSON object with a string `text` field.
"""

from __future__ import annotations

import glob
import hashlib
import sysconfig
from pathlib import Path
from typing import Iterator

from lm.data.records import iter_jsonl
from lm.errors import UserError

_GLOB_CHARS = set("*?[")
_SNIFF_BYTES = 8192  # a NUL byte in the head marks a binary file
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")


def _relkey(root: Path, path: Path) -> str:
    return path.relative_to(root).as_posix()


def _is_hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def is_jsonl(path: Path) -> bool:
    return path.name.endswith(JSONL_SUFFIXES)


def _looks_binary(path: Path) -> bool:
    if is_jsonl(path):  # gzip is binary on disk but holds text documents
        return False
    with open(path, "rb") as f:
        return b"\0" in f.read(_SNIFF_BYTES)


def stdlib_files() -> list[Path]:
    """The .py files of this interpreter's standard library (no third-party packages)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in root.rglob("*.py")
        if p.is_file() and not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)
    ]
    return sorted(files, key=lambda p: _relkey(root, p))


def _glob_root(spec: str) -> Path:
    """The longest leading part of a glob pattern without wildcards: paths are relative to it."""
    parts = Path(spec).parts
    fixed = []
    for part in parts:
        if _GLOB_CHARS & set(part):
            break
        fixed.append(part)
    return Path(*fixed) if fixed else Path(".")


def _text_files(root: Path, candidates) -> list[Path]:
    # Hidden files and dirs (.git, .DS_Store) and binary files are not text to learn from.
    files = [p for p in candidates if p.is_file() and not _is_hidden(p.relative_to(root)) and not _looks_binary(p)]
    return sorted(files, key=lambda p: _relkey(root, p))


def resolve_corpus(spec: str, label: str = "data.corpus") -> tuple[Path, list[Path]]:
    """Return (root, files) for a corpus spec; raise UserError (naming the config key `label`) if it names no text."""
    if spec == "stdlib":
        return Path(sysconfig.get_paths()["stdlib"]), stdlib_files()
    if _GLOB_CHARS & set(spec):
        root = _glob_root(spec)
        files = _text_files(root, (Path(p) for p in glob.glob(spec, recursive=True)))
    else:
        path = Path(spec)
        if not path.exists():
            raise UserError(f"{label}: '{spec}' does not exist; give a directory, a glob, or 'stdlib'")
        if path.is_file():
            root, files = path.parent, [path]
        elif (path / "report.json").is_file() and list(path.glob("part-*.jsonl.gz")):
            root, files = path, sorted(path.glob("part-*.jsonl.gz"))  # `lm curate` output: its shards only
        else:
            root = path
            files = _text_files(root, path.rglob("*"))
    if not files:
        raise UserError(
            f"{label}: '{spec}' contains no text files (hidden and binary files are skipped); "
            "point it at a directory or glob with text"
        )
    if all(p.stat().st_size == 0 for p in files):
        raise UserError(f"{label}: all {len(files)} files of '{spec}' are empty")
    return root, files


def unit_hash(key: bytes) -> float:
    """A number in [0, 1) from bytes: the same on every machine and Python run."""
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") / 2.0**64


def _unit_hash(root: Path, path: Path) -> float:
    """`unit_hash` of the path relative to the corpus root."""
    return unit_hash(_relkey(root, path).encode("utf-8"))


def split_files(root: Path, files: list[Path], heldout_fraction: float) -> tuple[list[Path], list[Path]]:
    """Split files into (train, heldout) by a hash of each relative path.

    Membership depends only on the path, not on the list order or the other
    files, so adding a file never moves another across the split.
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise UserError(f"data.heldout_fraction: {heldout_fraction} must be between 0 and 1 (exclusive), e.g. 0.05")
    if len(files) < 2:
        raise UserError(
            f"data.corpus: {len(files)} non-empty file(s) under '{root}'; at least 2 are needed "
            "to hold one out for evaluation"
        )
    ranked = sorted(files, key=lambda p: (_unit_hash(root, p), _relkey(root, p)))
    n_heldout = sum(_unit_hash(root, p) < heldout_fraction for p in ranked)
    # Both parts must be non-empty: a tiny corpus still gets one held-out file.
    n_heldout = min(max(n_heldout, 1), len(files) - 1)
    order = lambda ps: sorted(ps, key=lambda p: _relkey(root, p))  # noqa: E731
    return order(ranked[n_heldout:]), order(ranked[:n_heldout])


def _jsonl_text(obj) -> str:
    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
        found = f"keys {sorted(obj)}" if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(f"expected a JSON object with a string 'text' field, found {found}")
    return obj["text"]


def iter_documents(path: Path) -> Iterator[tuple[bytes | str, str]]:
    """Yields (document, where) pairs; `where` is 'file' or 'file:line' for error messages.

    Plain files yield their raw bytes (decoding is the tokenizer's business); JSONL
    files yield each line's `text`. Blank JSONL lines are skipped.
    """
    if not is_jsonl(path):
        yield path.read_bytes(), str(path)
        return
    for line_no, text in iter_jsonl(
        path, _jsonl_text, expected='one {"text": ...} object per line', bad_json="not a JSON object"
    ):
        yield text, f"{path}:{line_no}"
