"""One style whoever writes the file: ruff's lint rules and formatter, as configured in pyproject.toml."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PATHS = ["lm", "tests", "bench", "launch", "configs"]


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args, *PATHS], cwd=ROOT, capture_output=True, text=True)


def test_lint_rules_hold():
    out = ruff("check", "--no-cache", "--output-format=concise")
    assert out.returncode == 0, out.stdout + out.stderr


def test_code_is_formatted():
    out = ruff("format", "--check", "--no-cache")
    assert out.returncode == 0, "run `ruff format`:\n" + out.stdout + out.stderr
