"""`lm train` end to end on a small corpus: outputs, resume, and one-line user errors."""

import json
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest

from lm.cli import main

# The byte-level data path without curation: the default config's curation and tokenizer
# training have their own tests.
BYTES = ["--config.data.curate=false", "--config.data.tokenizer=byte", "--config.model.vocab_size=264"]
SMALL = [
    *BYTES,
    "--config.model.d_model=32",
    "--config.model.n_layers=2",
    "--config.model.n_heads=2",
    "--config.model.n_kv_heads=1",
    "--config.model.d_ff=64",
    "--config.data.seq_len=32",
    "--config.train.batch_size=16",
    "--config.eval.batches=2",
    "--config.eval.batch_size=8",
    "--config.train.sample_tokens=16",
    "--config.optim.warmup_steps=5",
    "--config.optim.decay_steps=40",
    "--config.train.peak_flops=1e11",
    "--no-progress",
]


def train(workdir, corpus, steps, *extra):
    return main(
        [
            "train",
            "--workdir",
            str(workdir),
            f"--config.data.corpus={corpus}",
            f"--config.train.steps={steps}",
            "--config.eval.every_steps=10",
            "--config.checkpoint.every_steps=10",
            *SMALL,
            *extra,
        ]
    )


def final_params(workdir, step):
    manager = ocp.CheckpointManager(pathlib.Path(workdir, "checkpoints").absolute(), item_names=("state", "data"))
    restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    return restored["state"]["params"]


@pytest.mark.slow
def test_train_writes_everything_and_resume_is_exact(tmp_path, corpus, capsys):
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert train(straight, corpus, 20) == 0
    rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [10, 20]
    for r in steps:
        assert {"loss", "lr", "grad_norm", "tokens_per_s", "mfu"} <= r.keys()
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 10, 20]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert (straight / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert list((straight / "tensorboard").glob("events.out.tfevents.*"))
    assert json.loads((straight / "config.json").read_text())["train"]["steps"] == 20
    assert (straight / "sample.txt").read_text()

    assert train(split, corpus, 10) == 0
    assert train(split, corpus, 20, "--resume") == 0
    a, b = final_params(straight, 20), final_params(split, 20)
    for x, y in zip(jax_leaves(a), jax_leaves(b)):
        np.testing.assert_array_equal(x, y)
    rows_b = [json.loads(line) for line in (split / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows_b if "loss" in r] == [r["loss"] for r in steps]

    summary = json.loads((straight / "summary.json").read_text())
    assert summary["run_tokens_per_s"] > 0 and summary["peak_flops"] == 1e11
    assert summary["peak_flops_source"].startswith("train.peak_flops")
    assert summary["run_mfu"] == pytest.approx(summary["run_tokens_per_s"] * rows[0]["flops_per_token"] / 1e11)

    # --resume on a finished run: says so, changes no file
    files = {p: p.read_bytes() for p in split.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert train(split, corpus, 20, "--resume") == 0
    assert "nothing left to do" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in split.rglob("*") if p.is_file()} == files


@pytest.mark.slow
def test_muon_with_warmup_stable_decay_resumes_exactly(tmp_path, corpus):
    recipe = ["--config.optim.optimizer=muon", "--config.optim.schedule=wsd", "--config.optim.decay_fraction=0.5"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert train(straight, corpus, 20, *recipe) == 0
    assert train(split, corpus, 10, *recipe) == 0
    assert train(split, corpus, 20, *recipe, "--resume") == 0
    for x, y in zip(jax_leaves(final_params(straight, 20)), jax_leaves(final_params(split, 20))):
        np.testing.assert_array_equal(x, y)
    rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["lr"] for r in rows if "lr" in r}
    assert lrs[10] == pytest.approx(3e-3)  # the plateau (decay over the last half of decay_steps=40)


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def test_user_errors_are_one_line(tmp_path, capsys, corpus):
    cases = [
        (["--config.data.corpus=" + str(tmp_path / "missing")], "does not exist"),
        (["--config", str(tmp_path / "nope.py")], "nope.py' does not exist"),
        (["--resume"], "no checkpoint"),
        (["--config.model.n_kv_heads=3"], "model.n_kv_heads"),
        (["--config.train.batch_size=12"], "8 batch shards"),
        (["--config.mesh.fsdp=3"], "xla_force_host_platform_device_count"),
        (["--config.data.tokenizer=" + str(tmp_path / "none.model")], "data.tokenizer"),
    ]
    for args, words in cases:
        code = main(["train", "--workdir", str(tmp_path / "w"), f"--config.data.corpus={corpus}", *BYTES, *args])
        err = capsys.readouterr().err.strip()
        assert code == 2 and err.startswith("lm: error:") and words in err and "\n" not in err, err
    # every check ran before any data work: nothing was prepared
    assert not any(pathlib.Path(os.environ["LM_CACHE_DIR"]).glob("shards-*/**/*corpus*"))


def test_checkpoint_presence_is_checked_before_any_data_work(tmp_path, capsys, corpus):
    """--resume without a checkpoint, or a fresh run over one, fails before data is prepared."""
    work = tmp_path / "w"
    assert main(["train", "--workdir", str(work), f"--config.data.corpus={corpus}", *BYTES, "--resume"]) == 2
    assert "no checkpoint" in capsys.readouterr().err and not (work / "data").exists()
    (work / "checkpoints" / "40").mkdir(parents=True)
    (work / "checkpoints" / "80").mkdir()
    (work / "checkpoints" / "120.orbax-checkpoint-tmp-1").mkdir()  # an unfinished save is not a step
    assert main(["train", "--workdir", str(work), f"--config.data.corpus={corpus}", *BYTES]) == 2
    err = capsys.readouterr().err
    assert "already holds checkpoints (steps 40..80)" in err and "--resume" in err
    assert not (work / "data").exists()


def test_empty_corpus_is_a_user_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    assert main(["train", "--workdir", str(tmp_path / "w"), f"--config.data.corpus={tmp_path / 'empty'}", *BYTES]) == 2
    assert "empty" in capsys.readouterr().err


def test_plan_prints_counts(capsys):
    assert main(["plan", "--config", "configs/llama3_8b.py"]) == 0
    out = capsys.readouterr().out
    assert "8,030,261,248" in out and "per device" not in out  # no target: the counts alone
    assert main(["plan", "--config", "configs/llama3_8b.py", "--target", "v5p-32"]) == 0
    # 8.03e9 params / 16 chips x 4 bytes = 1.87 GiB, Adam's moments twice that
    out = capsys.readouterr().out
    assert "fsdp=16 tensor=1" in out and "params                      1.87 GiB" in out
    assert "optimizer                   3.74 GiB" in out and "does NOT fit" in out  # 32 rows of 8192 a chip


def test_tokenizer_train_then_pretrain_with_it(tmp_path, capsys, corpus):
    assert (
        main(["tokenizer", "train", "--corpus", str(corpus), "--out", str(tmp_path / "tok"), "--vocab-size", "512"])
        == 0
    )
    model = tmp_path / "tok.model"
    assert model.is_file() and "512 pieces" in capsys.readouterr().out
    too_small = main(
        [
            "train",
            "--workdir",
            str(tmp_path / "a"),
            f"--config.data.corpus={corpus}",
            *BYTES,
            f"--config.data.tokenizer={model}",
        ]
    )
    assert too_small == 2 and "model.vocab_size is 264" in capsys.readouterr().err
    assert train(tmp_path / "b", corpus, 4, f"--config.data.tokenizer={model}", "--config.model.vocab_size=512") == 0
    rows = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["unigram_baseline"] > 0 and rows[-1]["step"] == 4


def test_default_config_curates_trains_a_tokenizer_then_pretrains(tmp_path, corpus):
    """The main job's data path (configs/tiny.py): curate -> sentencepiece -> token shards -> train."""
    src = tmp_path / "raw"
    shutil.copytree(corpus, src)
    shutil.copy(corpus / "abc.py", src / "abc_copy.py")  # an exact duplicate for curation to drop
    args = [a for a in SMALL if a not in BYTES] + [
        "--config.model.vocab_size=512",
        "--config.data.tokenizer=spm:512",
        "--config.data.heldout_fraction=0.3",
        "--config.data.workers=1",
    ]
    cache = tmp_path / "cache"
    assert (
        main(
            [
                "train",
                "--workdir",
                str(tmp_path / "w"),
                f"--config.data.corpus={src}",
                f"--config.data.cache_dir={cache}",
                "--config.train.steps=2",
                "--config.eval.every_steps=2",
                *args,
            ]
        )
        == 0
    )
    (report,) = cache.glob("curated-*/report.json")
    report = json.loads(report.read_text())
    assert report["in"]["docs"] == 13 and report["stages"]["exact_dedup"]["reasons"]["exact_duplicate"]["docs"] == 1
    stats = json.loads((tmp_path / "w" / "data_stats.json").read_text())
    assert stats["train_docs"] + stats["heldout_docs"] == report["kept"]["docs"]
    assert list(cache.glob("tokenizer-spm512-*/*.model"))
    assert (tmp_path / "w" / "tokenizer.model").read_bytes() == next(
        cache.glob("tokenizer-spm512-*/*.model")
    ).read_bytes()
    rows = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 2 and rows[-1]["eval_loss"] < 1.5 * math.log(512)


def test_help_mentions_config_overrides(capsys):
    for verb in ("train", "plan", "curate"):
        with pytest.raises(SystemExit):
            main([verb, "--help"])
        out = capsys.readouterr().out
        assert "--config.SECTION.KEY=VALUE" in out and "--config.optim.lr=1e-3" in out, verb


# ---- the life of a workdir: every check before any write, one writer, signals from the start ----

ROOT = pathlib.Path(__file__).resolve().parents[2]
SLOW = """
import sys, time
import {module} as patched
def slow(*args, **kwargs):
    print("{marker}", flush=True)
    time.sleep(600)  # until a signal ends it
patched.{name} = slow
from lm.cli import main
sys.exit(main(sys.argv[1:]))
"""


def no_data_work(*args, **kwargs):
    raise AssertionError("data preparation began before every check had passed")


def files(workdir) -> dict:
    return {p.relative_to(workdir): p.read_bytes() for p in pathlib.Path(workdir).rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def done_run(tmp_path_factory, corpus):
    """A finished 4-step run (its final checkpoint, metrics, plot, sample and summary); copy it to change it."""
    workdir = tmp_path_factory.mktemp("done") / "run"
    assert train(workdir, corpus, 4) == 0
    return workdir


def test_a_refused_resume_changes_no_file(done_run, tmp_path, corpus, capsys):
    work = tmp_path / "run"
    shutil.copytree(done_run, work)
    before = files(work)
    capsys.readouterr()
    assert train(work, corpus, 8, "--resume", "--config.model.n_layers=3") == 2
    err = capsys.readouterr().err.strip()
    assert "does not fit this config" in err and "model.n_layers=2 (checkpoint) vs 3 (now)" in err
    assert err.startswith("lm: error:") and "\n" not in err
    assert files(work) == before  # config.json still says n_layers=2: `lm sft --init` of it still works


def test_a_run_killed_after_its_final_checkpoint_finishes_on_resume(done_run, tmp_path, corpus, capsys):
    """A kill during the end-of-run evaluation, sample or plot: --resume restores the final
    checkpoint and does the end-of-run work, with the same result as the first time."""
    work = tmp_path / "run"
    shutil.copytree(done_run, work)
    for name in ("summary.json", "loss.png", "sample.txt"):
        (work / name).unlink()
    metrics = (work / "metrics.jsonl").read_bytes()
    assert train(work, corpus, 4, "--resume") == 0
    assert json.loads((work / "summary.json").read_text()) == json.loads((done_run / "summary.json").read_text())
    assert (work / "sample.txt").read_text() == (done_run / "sample.txt").read_text()
    assert (work / "loss.png").read_bytes() == (done_run / "loss.png").read_bytes()
    assert (work / "metrics.jsonl").read_bytes() == metrics  # nothing trained, nothing logged
    capsys.readouterr()
    assert train(work, corpus, 4, "--resume") == 0 and "nothing left to do" in capsys.readouterr().err

    # killed before even the loop's final metrics were kept: the summary takes those logged at the last step
    (work / "summary.json").unlink()
    (work / "final_metrics.json").unlink()
    assert train(work, corpus, 4, "--resume") == 0 and "final_metrics.json is missing" in capsys.readouterr().err
    first, again = (json.loads((w / "summary.json").read_text()) for w in (done_run, work))
    assert {k: again[k] for k in ("step", "loss", "eval_loss", "compile_s")} == {
        k: first[k] for k in ("step", "loss", "eval_loss", "compile_s")
    } and again["run_tokens_per_s"] is None


def test_a_second_writer_is_refused_naming_the_first(tmp_path, corpus, capsys, monkeypatch):
    import socket

    import lm.train.pretrain
    from lm.train.workdir import lock_workdir

    monkeypatch.setattr(lm.train.pretrain, "prepare_pretrain_data", no_data_work)
    with lock_workdir(tmp_path / "w"):
        assert train(tmp_path / "w", corpus, 4) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lm: error:") and "\n" not in err
    assert f"in use by another run (pid {os.getpid()} on host {socket.gethostname()} since" in err


def test_unwritable_outputs_are_one_line_before_any_data_work(tmp_path, corpus, capsys, monkeypatch):
    import lm.train.pretrain
    from tests.train.test_workdir import _permissions_apply

    if not _permissions_apply():
        pytest.skip("root ignores file permissions")
    monkeypatch.setattr(lm.train.pretrain, "prepare_pretrain_data", no_data_work)
    locked = tmp_path / "locked"
    (locked / "w").mkdir(parents=True)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "metrics.jsonl").write_text("")
    (tmp_path / "c" / "checkpoints").mkdir(parents=True)  # a fresh run would train, then fail its first save
    cases = [
        (locked / "w" / "run", locked / "w"),
        (tmp_path / "m", tmp_path / "m" / "metrics.jsonl"),
        (tmp_path / "c", tmp_path / "c" / "checkpoints"),
    ]
    for _, unwritable in cases:
        unwritable.chmod(0o555)
    try:
        for workdir, unwritable in cases:
            assert train(workdir, corpus, 4) == 2
            err = capsys.readouterr().err.strip()
            assert err.startswith("lm: error:") and "\n" not in err and f"'{unwritable}'" in err, err
    finally:
        for _, unwritable in cases:
            unwritable.chmod(0o755)


def start_patched(module: str, name: str, marker: str, args: list[str]):
    """`lm ARGS` in a subprocess whose `module.name` announces itself on stdout, then waits for a signal."""
    from tests.conftest import xla_flags

    script = SLOW.format(module=module, name=name, marker=marker)
    env = os.environ | {"XLA_FLAGS": xla_flags(8), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in iter(proc.stdout.readline, ""):
        if line.strip() == marker:
            return proc
    raise AssertionError(f"it ended before '{marker}': {proc.communicate()[1][-2000:]}")


def test_sigterm_during_data_preparation_stops_cleanly(tmp_path, corpus):
    work = tmp_path / "w"
    args = ["train", "--workdir", str(work), f"--config.data.corpus={corpus}", *SMALL]
    proc = start_patched("lm.data.prepare", "prepare_pretrain_data", "preparing data", args)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("lm: stopped by SIGTERM during data preparation; nothing is lost"), err[-2000:]
    assert "run again with the same command" in last and "--resume" not in last
    assert not work.exists()  # nothing was written, not even the lock


@pytest.mark.slow
def test_sigterm_during_the_end_of_run_work_finishes_on_resume(tmp_path, corpus, capsys):
    work = tmp_path / "w"
    args = [
        "train",
        "--workdir",
        str(work),
        f"--config.data.corpus={corpus}",
        "--config.train.steps=2",
        "--config.eval.every_steps=2",
        *SMALL,
    ]
    proc = start_patched("lm.train.pretrain", "_sample", "sampling", args)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("lm: stopped by SIGTERM during the end-of-run evaluation"), err[-2000:]
    assert last.endswith("--resume") and not (work / "summary.json").exists()
    assert main(args + ["--resume"]) == 0
    assert json.loads((work / "summary.json").read_text())["step"] == 2 and (work / "loss.png").is_file()


def test_a_stop_swallowed_where_it_landed_still_keeps_the_run_unfinished(tmp_path, corpus, monkeypatch, capsys):
    """Python drops an exception raised inside a gc callback (jax has one): the stop it carried must
    still stop the run at the next safe point, before summary.json marks the run done."""
    import lm.train.pretrain as pretrain
    from lm.train.faults import StopRequested

    sample = pretrain._sample

    def swallowed(*a, **k):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs at the next bytecode boundary
                pass
        except StopRequested:
            pass  # what a gc callback does to it
        return sample(*a, **k)

    monkeypatch.setattr(pretrain, "_sample", swallowed)
    work = tmp_path / "w"
    args = [
        "train",
        "--workdir",
        str(work),
        f"--config.data.corpus={corpus}",
        "--config.train.steps=2",
        "--config.eval.every_steps=2",
        *SMALL,
    ]
    assert main(args) == 0
    assert "lm: stopped by SIGTERM" in capsys.readouterr().err
    assert not (work / "summary.json").exists()
    monkeypatch.setattr(pretrain, "_sample", sample)
    assert main(args + ["--resume"]) == 0
    assert json.loads((work / "summary.json").read_text())["step"] == 2
