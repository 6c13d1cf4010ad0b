"""eval.sets: language-modelling sets scored during training equal `lm eval` on the checkpoint."""

import json

import pytest

from lm.cli import main
from lm.config import parse_sets
from lm.errors import UserError
from tests.e2e.test_cli_train import SMALL


def test_set_specs_need_a_name():
    assert parse_sets(("a=x.txt", "b=dir/")) == [("a", "x.txt"), ("b", "dir/")]
    with pytest.raises(UserError, match=r"eval.sets\[0\] = 'x.txt': expected NAME=PATH"):
        parse_sets(("x.txt",))


@pytest.mark.slow
def test_sets_during_training_equal_lm_eval_of_the_checkpoint(tmp_path, corpus, capsys):
    (tmp_path / "held.jsonl").write_text(
        "".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"}) + "\n" for i in range(20))
    )
    work = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--workdir",
                str(work),
                f"--config.data.corpus={corpus}",
                "--config.train.steps=6",
                "--config.eval.every_steps=3",
                *SMALL,
                "--config.data.seq_len=64",
                "--no-progress",
                f"--config.eval.sets=held={tmp_path / 'held.jsonl'}",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    during = [r for r in rows if "eval/held/bits_per_byte" in r]
    assert [r["step"] for r in during] == [0, 3, 6]
    assert during[0]["eval/held/bits_per_byte"] > during[-1]["eval/held/bits_per_byte"]
    assert "eval/held/bits_per_byte" in capsys.readouterr().out
    out = tmp_path / "r.json"
    assert (
        main(
            [
                "eval",
                "--workdir",
                str(work),
                "--no-progress",
                "--out",
                str(out),
                "--tasks",
                f"held={tmp_path / 'held.jsonl'}",
            ]
        )
        == 0
    )
    m = json.loads(out.read_text())["tasks"]["held"]["metrics"]
    assert m["bits_per_byte"] == pytest.approx(during[-1]["eval/held/bits_per_byte"], rel=1e-5)
    assert m["loss"] == pytest.approx(during[-1]["eval/held/loss"], rel=1e-5)
    assert (work / "loss.png").stat().st_size > 0
