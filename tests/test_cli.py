"""Every `lm` verb registers the same way (add_parser, run), `lm --help` lists them all, `lm reward score`
is a sub-action of `lm reward`, and building the parser imports no jax (the CPU flags come first)."""

import subprocess
import sys

import pytest

from lm import cli
from lm.errors import UserError
from lm.train import cli as train_cli
from lm.verb import Stopped

VERBS = {
    "train",
    "sft",
    "dpo",
    "rft",
    "online-dpo",
    "kto",
    "reward",
    "rl",
    "distill",
    "demo",
    "tokenizer",
    "export",
    "import",
    "tokenize",
    "curate",
    "plan",
    "scale",
    "sample",
    "serve",
    "eval",
    "contamination",
    "harness",
}


def test_every_verb_exposes_add_parser_and_run():
    for verb in cli.VERBS:
        assert callable(verb.add_parser) and callable(verb.run), verb
    _, reaches = cli._parser()
    assert set(reaches) == VERBS and set(reaches.values()) == set(cli.VERBS)


def test_help_lists_every_verb(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    assert done.value.code == 0
    listed = capsys.readouterr().out
    assert all(f"\n    {verb} " in listed for verb in VERBS), listed
    assert "reward-score" not in listed


def test_reward_score_is_a_sub_action_of_reward(tmp_path, capsys, monkeypatch):
    parser, reaches = cli._parser()
    args = parser.parse_args(["reward", "score", "--workdir", "X", "--texts", "Y"])
    assert reaches[args.verb] is train_cli.REWARD and (args.action, args.workdir, args.texts) == ("score", "X", "Y")
    args = parser.parse_args(["reward", "--init", "I", "--data", "D", "--workdir", "W"])
    assert args.action is None and (args.init, args.data, args.workdir) == ("I", "D", "W")
    monkeypatch.setenv("XLA_FLAGS", "")  # the verb sets its CPU flags; restored after the test
    texts = tmp_path / "missing.jsonl"
    assert cli.main(["reward", "score", "--workdir", str(tmp_path / "run"), "--texts", str(texts)]) == 2
    assert capsys.readouterr().err == f"lm: error: --texts {texts}: no such file\n"


def test_training_a_reward_model_still_requires_its_flags(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["reward", "--init", "I"])
    assert done.value.code == 2
    assert "lm reward: error: the following arguments are required: --data, --workdir" in capsys.readouterr().err


class Fake:
    """A verb whose run raises what it is given."""

    def __init__(self, error):
        self.error = error

    def add_parser(self, sub):
        sub.add_parser("fake").add_argument("--resume", action="store_true")

    def run(self, args, overrides):
        assert overrides == ["optim.lr=1"]
        raise self.error


@pytest.mark.parametrize(
    "error, code, message",
    [
        (UserError("bad input"), 2, "lm: error: bad input\n"),
        (
            Stopped("SIGTERM", 7),
            0,
            "lm: stopped by SIGTERM at step 7; checkpoint saved. Continue with: lm fake --config.optim.lr=1 --resume\n",
        ),
    ],
)
def test_the_edge_reports_user_errors_and_stops(monkeypatch, capsys, error, code, message):
    monkeypatch.setattr(cli, "VERBS", (Fake(error),))
    assert cli.main(["fake", "--resume", "--config.optim.lr=1"]) == code
    assert capsys.readouterr().err == message


def test_building_the_parser_imports_no_jax():
    code = "import sys; from lm.cli import _parser; _parser(); assert 'jax' not in sys.modules, 'jax imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
