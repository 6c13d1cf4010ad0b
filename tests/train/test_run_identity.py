"""A run knows what it is: --resume restores only its own checkpoints (its stage, its run, its
trajectory), and a refusal or a storage fault moves nothing."""

import json
import pathlib
import re
import shlex
import shutil

import pytest

from lm.cli import main
from lm.store.checkpoint import Checkpointer
from lm.store.checkpoint_checks import seal
from lm.store.checkpoint_read import saved_steps
from lm.train.workdir import lock_workdir
from tests.e2e.test_cli_train import SMALL


def _copy(small_base, tmp_path) -> pathlib.Path:
    work = tmp_path / "run"
    shutil.copytree(small_base, work)
    return work


def _resume(work, corpus, *extra, steps=12):
    return main(
        [
            "train",
            "--workdir",
            str(work),
            f"--config.data.corpus={corpus}",
            f"--config.train.steps={steps}",
            "--config.eval.every_steps=10",
            *SMALL,
            "--config.data.seq_len=64",
            "--resume",
            *extra,
        ]
    )


def _files(work) -> dict:
    return {p: p.read_bytes() for p in work.rglob("*") if p.is_file() and p.name != ".lock"}


def _error(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lm: error:")]
    assert len(lines) == 1, lines
    return lines[0]


def test_another_stage_is_refused_before_any_data_work(small_base, tmp_path, capsys):
    work = _copy(small_base, tmp_path)
    before = _files(work)
    data = tmp_path / "data.jsonl"
    data.write_text("")  # never read: the refusal comes first
    for verb, flag in (("sft", "--data"), ("dpo", "--data"), ("rl", "--data")):
        capsys.readouterr()
        assert (
            main(
                [verb, "--workdir", str(work), "--init", str(small_base), flag, str(data), "--resume", "--no-progress"]
            )
            == 2
        )
        line = _error(capsys)
        assert f"checkpoint step 10 in '{work / 'checkpoints'}' is not this run's to resume" in line, line
        assert f"stage: train (checkpoint) vs {verb} (now)" in line and "made by `lm train --workdir" in line, line
    assert _files(work) == before and saved_steps(work / "checkpoints") == [10]
    # The advice works: the command that made the run resumes it (here: a finished run, nothing to do).
    command = re.search(r"resume it with `([^`]+)`", line).group(1).replace(str(small_base), str(work))
    words = shlex.split(command)
    assert words[0] == "lm" and words[-1] == "--resume" and main(words[1:]) == 0


@pytest.mark.slow
def test_other_trajectory_settings_are_refused_and_neutral_changes_resume(small_base, corpus, tmp_path, capsys):
    work = _copy(small_base, tmp_path)
    before = _files(work)
    capsys.readouterr()
    assert _resume(work, corpus, "--config.optim.lr=0.001", "--config.train.seed=3") == 2
    line = _error(capsys)
    assert "optim.lr: 0.003 (checkpoint) vs 0.001 (now)" in line and "train.seed: 0 (checkpoint) vs 3 (now)" in line
    assert _files(work) == before
    # warmup-stable-decay over 8 steps decays from update 7: the last of the 10 updates made get other rates
    assert _resume(work, corpus, "--config.optim.decay_steps=8") == 2
    line = _error(capsys)
    assert (
        "the learning rate of the 10 updates made differs (train.steps=10 (checkpoint) vs 12 (now), "
        "optim.decay_steps=40 (checkpoint) vs 8 (now))" in line
    ), line[:700]
    # Intervals, progress and the length of a run whose schedule is set apart (optim.decay_steps) may change.
    assert (
        _resume(
            work,
            corpus,
            "--config.train.log_every=1",
            "--config.eval.every_steps=2",
            "--config.checkpoint.every_steps=1",
        )
        == 0
    )
    assert saved_steps(work / "checkpoints")[-1] == 12
    assert "resumed from step 10" in capsys.readouterr().out


def test_a_checkpoint_of_another_run_is_refused(small_base, corpus, tmp_path, capsys):
    """Checkpoints copied into a workdir whose run.json names another run (same config, same shapes)."""
    work = _copy(small_base, tmp_path)
    record = json.loads((work / "run.json").read_text())
    (work / "run.json").write_text(json.dumps(record | {"run_id": "0123456789ab"}))
    capsys.readouterr()
    assert _resume(work, corpus) == 2
    line = _error(capsys)
    assert f"run: {record['run_id']} (checkpoint) vs 0123456789ab (this workdir)" in line, line


@pytest.mark.slow
def test_data_are_named_by_content_not_path(small_base, corpus, tmp_path, capsys):
    work = _copy(small_base, tmp_path)
    moved = tmp_path / "moved-corpus"
    shutil.copytree(corpus, moved)
    changed = tmp_path / "changed-corpus"
    shutil.copytree(corpus, changed)
    (changed / "abc.py").write_text((changed / "abc.py").read_text().replace("abstract", "concrete"))
    capsys.readouterr()
    assert _resume(work, changed) == 2
    line = _error(capsys)
    assert re.search(r"data shards#1: '\w+' \(checkpoint\) vs '\w+' \(now\)", line), line
    assert _resume(work, moved) == 0  # the same bytes elsewhere: the same run


@pytest.mark.slow
def test_a_checkpoint_without_identity_resumes_with_one_warning(small_base, corpus, tmp_path, capsys):
    work = _copy(small_base, tmp_path)
    path = work / "checkpoints" / "10" / "meta" / "metadata"
    meta = json.loads(path.read_text())
    body = {k: v for k, v in meta.items() if k not in ("identity", "meta_checksum")}
    path.write_text(json.dumps(seal(body)))
    (work / "run.json").unlink()
    capsys.readouterr()
    assert _resume(work, corpus) == 0
    out = capsys.readouterr().out
    assert out.count("predates run identities") == 1 and "resumed from step 10" in out


@pytest.mark.slow
def test_an_edited_metrics_row_is_found_and_the_advice_works(small_base, corpus, tmp_path, capsys):
    work = _copy(small_base, tmp_path)
    path = work / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    line_no = next(i for i, r in enumerate(rows, 1) if r["step"] == 10 and "loss" in r)
    rows[line_no - 1]["loss"] += 0.5  # still valid JSON, another value
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = _files(work)
    capsys.readouterr()
    assert _resume(work, corpus) == 2
    line = _error(capsys)
    assert f"{path}:{line_no}: the row of step 10 is not the one the run wrote" in line, line
    assert _files(work) == before
    move = re.search(r"\(mv '([^']+)' '([^']+)'\)", line)
    pathlib.Path(move.group(1)).rename(move.group(2))
    assert _resume(work, corpus) == 0
    assert min(json.loads(r)["step"] for r in path.read_text().splitlines()) > 10


def test_a_storage_fault_moves_nothing_and_the_advice_works(small_base, corpus, tmp_path, capsys, monkeypatch):
    """Every checkpoint unreadable (permissions): reported, nothing set aside; fixed, --resume works."""
    work = _copy(small_base, tmp_path)
    before = _files(work)
    real = Checkpointer._restore_checked

    def denied(self, step, *args):
        raise PermissionError(13, "Permission denied", str(self.directory / str(step) / "state"))

    monkeypatch.setattr(Checkpointer, "_restore_checked", denied)
    capsys.readouterr()
    assert _resume(work, corpus) == 2
    line = _error(capsys)
    assert "checkpoint step 10" in line and "cannot be read (permission denied" in line, line
    assert "nothing was moved" in line and "run the same command with --resume again" in line
    assert _files(work) == before and not (work / "rejected_checkpoints").exists()
    monkeypatch.setattr(Checkpointer, "_restore_checked", real)
    assert _resume(work, corpus) == 0


def test_a_folder_the_run_writes_replaced_by_a_file_is_refused_up_front(small_base, corpus, tmp_path, capsys):
    work = _copy(small_base, tmp_path)
    shutil.rmtree(work / "tensorboard")
    (work / "tensorboard").write_text("not a folder")
    before = _files(work)
    capsys.readouterr()
    assert _resume(work, corpus) == 2
    line = _error(capsys)
    assert f"'{work / 'tensorboard'}' is a file where the run keeps a folder" in line, line
    assert _files(work) == before


def test_a_second_fresh_writer_is_told_who_holds_the_workdir(small_base, corpus, tmp_path, capsys):
    work = _copy(small_base, tmp_path)
    with lock_workdir(work):
        capsys.readouterr()
        assert main(["train", "--workdir", str(work), f"--config.data.corpus={corpus}", *SMALL]) == 2
        line = _error(capsys)
    assert "is in use by another run (pid" in line and "--resume" not in line, line


def test_a_first_save_that_fails_advises_a_fresh_start(tmp_path):
    checkpointer = Checkpointer(tmp_path / "checkpoints")
    with pytest.raises(Exception) as raised:
        with checkpointer._reporting(2):
            raise OSError(28, "No space left on device")
    message = str(raised.value)
    assert "no space left on device" in message and "no checkpoint is saved" in message
    assert "run the same command again without --resume" in message and "then --resume" not in message


def test_the_docs_list_exactly_the_keys_a_resume_may_change():
    from lm.train.identity import MODEL_KEYS, NEUTRAL

    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "resume.md").read_text()
    block = page.split("<!-- neutral-keys -->")[1].split("<!-- /neutral-keys -->")[0]
    listed = set(re.findall(r"`([a-z_.*]+)`", block))
    want = {k + "*" if k.endswith(".") else k for k in NEUTRAL} | set(MODEL_KEYS) | {"*.eval_*"}
    assert listed == want, listed ^ want
