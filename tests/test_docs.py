"""Every `lm ...` command that README.md and docs/*.md show in a ```bash, ```sh or ```console block
is checked against the real CLI:

- it parses with the parser `lm` itself builds (lm.cli), so an unknown verb or flag fails;
- every `--config.a.b=v` override names a real key of the config the command uses, with a value of
  the key's type (lm.config.load_config: the CLI's own loading, merging and override checks), and
  every `--config FILE` exists;
- the blocks marked `<!-- run -->` (cheap commands: the planner without --compile) run for real, in
  a temporary directory, and must exit 0.

Commands that need earlier outputs (a workdir, a data file) only parse; paths and placeholders
such as HF_DIR are fine as arguments. Nothing here imports jax."""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.M | re.S)
RUN_MARK = "<!-- run -->"
SHELL = ("bash", "sh", "console", "shell")
SEPARATORS = {"&&", "||", ";", "|", "&"}
ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


class Command:
    def __init__(self, doc: pathlib.Path, line: int, argv: list[str], run: bool):
        self.doc, self.line, self.argv, self.run = doc, line, argv, run

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}: lm {shlex.join(self.argv)}"


def _logical_lines(body: str, start: int):
    """(line number, text) of each shell line, with `\\` continuations joined and `$ ` prompts dropped."""
    pending, first = "", None
    for offset, raw in enumerate(body.split("\n")):
        line = raw.rstrip()
        if not pending:
            first = start + offset
            stripped = line.lstrip()
            if stripped.startswith("$ "):
                line = stripped[2:]
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        yield first, pending + line
        pending = ""
    if pending:
        yield first, pending


def _tokens(text: str) -> list[str]:
    lexer = shlex.shlex(text, posix=True, punctuation_chars="&|;")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


LAUNCHERS = re.compile(r"(^|/)launch/.*\.(sh|sbatch)$")


def _verbs() -> set[str]:
    import argparse

    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices)


def _launched(command: list[str]) -> list[str] | None:
    """The `lm` argv a launcher (launch/*.sh, launch/gpu_slurm.sbatch) runs: its verb and what follows,
    as each process gets it (--distributed); None when the line runs no launcher."""
    at = next((i for i, t in enumerate(command) if LAUNCHERS.search(t)), None)
    if at is None:
        return None
    verbs = _verbs()
    rest = command[at + 1 :]
    start = next((i for i, t in enumerate(rest) if t in verbs), None)
    return None if start is None else [rest[start], "--distributed", *rest[start + 1 :]]


def _lm_argvs(tokens: list[str]):
    """The argv (after `lm`) of each `lm` command in a line's tokens, a launcher's included; env-var
    prefixes skipped and `[optional]` brackets dropped (an optional flag is checked as if given)."""
    command: list[str] = []
    for tok in [*tokens, ";"]:
        if tok not in SEPARATORS:
            command.append(tok)
            continue
        while command and ENV.match(command[0]):
            command.pop(0)
        argv = None
        if command and (command[0] == "lm" or command[0].endswith("/bin/lm")):
            argv = command[1:]
        elif command:
            argv = _launched(command)
        if argv is not None:
            argv = [t.removeprefix("[").removesuffix("]") for t in argv]
            yield [t for t in argv if t]
        command = []


def doc_commands(doc: pathlib.Path, text: str | None = None) -> list[Command]:
    text = doc.read_text() if text is None else text
    found = []
    for m in FENCE.finditer(text):
        if m.group(1) not in SHELL:
            continue
        before = text[: m.start()].rstrip()
        run = before.endswith(RUN_MARK)
        start = text.count("\n", 0, m.start(2)) + 1
        for line, logical in _logical_lines(m.group(2), start):
            try:
                tokens = _tokens(logical)
            except ValueError as e:
                raise AssertionError(f"{doc.relative_to(ROOT)}:{line}: cannot split {logical!r}: {e}") from None
            found += [Command(doc, line, argv, run) for argv in _lm_argvs(tokens)]
    return found


def all_commands() -> list[Command]:
    return [c for doc in DOCS for c in doc_commands(doc)]


def _parser():
    from lm import cli

    build = getattr(cli, "build_parser", None) or cli._parser
    built = build()
    return built[0] if isinstance(built, tuple) else built


def check(command: Command, parser) -> None:
    """Fails with the doc's place and the CLI's message when the command would not start."""
    from lm import cli
    from lm.config import load_config
    from lm.errors import UserError

    try:
        rest, overrides = cli._split_overrides(command.argv)
    except UserError as e:
        raise AssertionError(f"{command.where}\n  {e}") from None
    import contextlib
    import io

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(rest)
    except SystemExit:
        raise AssertionError(f"{command.where}\n  {err.getvalue().strip().splitlines()[-1]}") from None
    path = getattr(args, "config", None)
    if path is not None and not (ROOT / path).is_file():
        raise AssertionError(f"{command.where}\n  --config {path}: no such file")
    if path is not None or overrides:
        cwd = os.getcwd()
        os.chdir(ROOT)
        try:
            load_config(path, overrides)
        except UserError as e:
            raise AssertionError(f"{command.where}\n  {e}") from None
        finally:
            os.chdir(cwd)


def test_docs_show_commands():
    commands = all_commands()
    assert len(commands) > 40, "the docs' commands were not found: is the code-block parsing broken?"
    assert any(c.run for c in commands), f"no block is marked {RUN_MARK}"


def test_every_documented_command_parses():
    parser = _parser()
    failures = []
    for command in all_commands():
        try:
            check(command, parser)
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, "commands in the docs that `lm` would refuse:\n" + "\n".join(failures)


def test_a_flag_that_does_not_exist_fails(tmp_path):
    """The checker itself: a doc showing an unknown flag, verb or config key, or a missing config, fails."""
    parser = _parser()
    doc = tmp_path / "bad.md"
    bad = {
        "lm train --config configs/tiny.py --workdir runs/a --no-such-flag": "unrecognized arguments",
        "lm trian --workdir runs/a": "invalid choice",
        "lm train --workdir runs/a --config.optim.no_such_key=1": "unknown config key 'optim.no_such_key'",
        "lm train --workdir runs/a --config.optim.lr=fast": "optim.lr",
        "lm plan --config configs/no_such.py": "no such file",
    }
    for line, expected in bad.items():
        doc.write_text(f"text\n\n```bash\n$ XLA_FLAGS=x {line} \\\n  # a comment\n```\n")
        [command] = doc_commands(doc)
        command.doc = ROOT / "docs" / "bad.md"
        with pytest.raises(AssertionError, match=re.escape(expected)):
            check(command, parser)
    doc.write_text(
        "```sh\nlm sft --init A --data B --workdir C [--eval-data D] && .venv/bin/lm sample --workdir C\n```\n"
    )
    assert [c.argv for c in doc_commands(doc)] == [
        ["sft", "--init", "A", "--data", "B", "--workdir", "C", "--eval-data", "D"],
        ["sample", "--workdir", "C"],
    ]


@pytest.mark.parametrize("command", [c for c in all_commands() if c.run], ids=lambda c: " ".join(c.argv[:4]))
def test_marked_commands_run(command, tmp_path):
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    lm = pathlib.Path(sys.executable).with_name("lm")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([str(lm), *command.argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{command.where}\n{done.stderr[-2000:]}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercased, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_links_between_pages_resolve():
    """Every relative link of README.md and docs/ names a file that exists, and an #anchor a heading of it."""
    broken = []
    for doc in DOCS:
        text = FENCE.sub("", doc.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}: no such file")
            elif anchor and file.suffix == ".md":
                slugs = {_slug(h) for h in re.findall(r"^#+ (.*)$", FENCE.sub("", file.read_text()), re.M)}
                if anchor not in slugs:
                    broken.append(f"{doc.relative_to(ROOT)}: {target}: no such heading")
    assert not broken, "\n".join(broken)
