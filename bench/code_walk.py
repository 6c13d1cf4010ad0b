"""How far a reader walks through the code: the `lm` files that run from the command line to the
first generated token of `lm sample --params HF_DIR` (a tiny random Llama written by transformers),
in the order their functions are first called (imports alone do not count), and the calls that climb
back up the layers of pyproject.toml's import-linter contract (a call from a module into a module of
a higher layer: a callback or a function handed down). Prints both counts and the walk.

    .venv/bin/python bench/code_walk.py                # this checkout
    PYTHONPATH=OTHER .venv/bin/python bench/code_walk.py --root OTHER   # another checkout, same way
"""

from __future__ import annotations

import argparse
import inspect
import os
import pathlib
import sys
import tempfile
import tomllib

REPO = pathlib.Path(__file__).resolve().parents[1]


def layers(root: pathlib.Path) -> list[list[str]]:
    """The contract's layers, top first, each a list of module prefixes."""
    contracts = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    table = next(c for c in contracts if c["type"] == "layers")["layers"]
    return [[m.strip() for m in entry.replace(":", "|").split("|")] for entry in table]


def layer_of(module: str, table: list[list[str]]) -> int | None:
    for i, names in enumerate(table):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    return None


def walk(root: pathlib.Path, argv: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """The lm modules entered (first entry order) while `lm ARGV` runs, and the upward calls."""
    package = str(root / "lm") + os.sep
    table = layers(root)
    order, climbs, seen = [], [], set()

    def module(frame) -> str | None:
        path = frame.f_code.co_filename
        if not path.startswith(package):
            return None
        rel = pathlib.Path(path).relative_to(root).with_suffix("")
        return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)

    def profile(frame, event, arg):
        if event != "call" or not frame.f_code.co_flags & inspect.CO_OPTIMIZED:
            return  # a module or class body runs on import: not a step of the walk
        callee = module(frame)
        if callee is None:
            return
        if callee not in seen:
            seen.add(callee)
            order.append(callee)
        caller = module(frame.f_back) if frame.f_back is not None else None
        if caller and caller != callee:
            a, b = layer_of(caller, table), layer_of(callee, table)
            if a is not None and b is not None and b < a:
                climbs.append((caller, callee))

    from lm.cli import main

    sys.setprofile(profile)
    try:
        rc = main(argv)
    finally:
        sys.setprofile(None)
    if rc != 0:
        raise SystemExit(f"lm {' '.join(argv)} exited {rc}")
    return order, climbs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=str(REPO), help="the checkout whose lm/ is walked (import it via PYTHONPATH)")
    args = p.parse_args()
    root = pathlib.Path(args.root).resolve()
    sys.path.append(str(REPO))  # tests.hf_models; lm itself comes from --root (PYTHONPATH)
    from tests.hf_models import write_model, write_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        hf = pathlib.Path(tmp) / "hf"
        write_model("llama3", hf)
        write_tokenizer(hf)
        order, climbs = walk(
            root, ["sample", "--params", str(hf), "--prompt", "a", "--max-new-tokens", "1", "--temperature", "0"]
        )
    files = sorted({m for m in order})
    print(
        f"lm sample --params HF_DIR to its first token: {len(files)} files of lm/ run, "
        f"{len(set(climbs))} distinct upward calls ({len(climbs)} in all)"
    )
    for m in order:
        print(f"  {m}")
    for caller, callee in sorted(set(climbs)):
        print(f"  climb: {caller} -> {callee}")


if __name__ == "__main__":
    main()
