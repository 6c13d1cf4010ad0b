"""The layers of DESIGN.md §2 hold: arrows point down only, the model imports no config module,
and nothing in lm is part of an import cycle, imports inside functions included (import-linter
contracts in pyproject.toml)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    tool = pathlib.Path(sys.executable).parent / "lint-imports"
    done = subprocess.run([str(tool), "--no-logo", "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 kept, 0 broken" in done.stdout


def test_a_cycle_breaks_the_contract(tmp_path):
    """The contract sees function-local imports: a copy of lm with one lazy import running back up fails."""
    import shutil

    shutil.copytree(ROOT / "lm", tmp_path / "lm", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    errors = tmp_path / "lm" / "model" / "params.py"
    errors.write_text(errors.read_text() + "\n\ndef _up():\n    from lm.train import steps  # noqa: F401\n")
    tool = pathlib.Path(sys.executable).parent / "lint-imports"
    done = subprocess.run(
        [str(tool), "--no-logo", "--no-cache"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode != 0
    assert "lm.model.params -> lm.train.steps" in done.stdout, done.stdout
