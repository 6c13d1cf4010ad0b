"""`lm sft` end to end from a small pretrained run: outputs and the exact-match report, LoRA's
adapter-only checkpoints and exact resume, export --merge, chat sampling, one-line errors."""

import json

import jax
import numpy as np
import pytest

from lm.cli import main
from lm.data.synthetic import write_sort_task
from tests.e2e.test_cli_train import final_params

SFT = [
    "--config.finetune.epochs=0",
    "--config.train.batch_size=8",
    "--config.eval.every_steps=5",
    "--config.checkpoint.every_steps=5",
    "--config.eval.batches=1",
    "--config.eval.batch_size=8",
    "--config.finetune.eval_examples=8",
    "--config.finetune.eval_max_new_tokens=8",
    "--config.train.peak_flops=1e11",
    "--no-progress",
]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, small_base):
    root = small_base.parent
    return root, write_sort_task(tmp_path_factory.mktemp("sft") / "task", n_train=300, n_heldout=8)


def sft(root, task, workdir, steps, *extra, held_out=True):
    heldout = ["--eval-data", str(task["heldout"])] if held_out else []
    return main(
        [
            "sft",
            "--init",
            str(root / "base"),
            "--data",
            str(task["train"]),
            *heldout,
            "--workdir",
            str(workdir),
            f"--config.train.steps={steps}",
            *SFT,
            *extra,
        ]
    )


@pytest.mark.slow
def test_full_sft_reports_response_loss_and_exact_match(base_run, tmp_path):
    root, task = base_run
    assert sft(root, task, tmp_path / "full", 10) == 0
    summary = json.loads((tmp_path / "full" / "summary.json").read_text())
    assert {"exact_match", "exact_match_init", "eval_loss", "eval_loss_init"} <= summary.keys()
    assert summary["exact_match_n"] == 8 and summary["data"]["examples_kept"] == 300
    assert summary["eval_loss"] < summary["eval_loss_init"]
    rows = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "loss" in r]
    assert logged and all(0 < r["masked_fraction"] < 1 and r["tokens"] > 0 for r in logged)
    assert (tmp_path / "full" / "loss.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_lora_checkpoints_hold_adapters_resume_exactly_and_merge(base_run, tmp_path, capsys):
    root, task = base_run
    lora = ["--config.model.lora_rank=4"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert sft(root, task, straight, 10, *lora, held_out=False) == 0
    assert sft(root, task, split, 5, *lora, held_out=False) == 0
    assert sft(root, task, split, 10, *lora, "--resume", held_out=False) == 0
    a, b = final_params(straight, 10), final_params(split, 10)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(a)[0]]
    assert paths and all("_lora_" in p for p in paths)  # the base is not in the checkpoint
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)

    from lm.store.load import load_params

    out = tmp_path / "merged.safetensors"
    assert main(["export", "--workdir", str(straight), "--out", str(out), "--merge"]) == 0
    merged = load_params(out)
    assert "embedding" in merged and not any("_lora_" in k for k in _keys(merged))
    answers = []
    for source in (["--workdir", str(straight)], ["--params", str(out)]):
        capsys.readouterr()
        assert (
            main(["sample", *source, "--chat", "--prompt", "sort 321", "--max-new-tokens", "4", "--temperature", "0"])
            == 0
        )
        answers.append(capsys.readouterr().out)
    assert answers[0] == answers[1]  # adapters folded in on load == the merged export


def _keys(tree, prefix=""):
    for k, v in tree.items():
        yield from (_keys(v, prefix + k + "/") if isinstance(v, dict) else [prefix + k])


def test_bad_data_is_one_line_naming_file_and_line(base_run, tmp_path, capsys):
    root, task = base_run
    bad = tmp_path / "bad.jsonl"
    bad.write_text(task["train"].read_text().splitlines()[0] + '\n{"messages": [{"role": "robot", "content": "x"}]}\n')
    assert main(["sft", "--init", str(root / "base"), "--data", str(bad), "--workdir", str(tmp_path / "w"), *SFT]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("lm: error:")]
    assert len(errors) == 1 and f"{bad}:2" in errors[0] and "robot" in errors[0]
    assert main(["sft", "--init", str(tmp_path / "nope"), "--data", str(bad), "--workdir", str(tmp_path / "w")]) == 2
    assert "--init" in capsys.readouterr().err


def test_a_refused_resume_leaves_the_run_as_it_was(base_run, tmp_path, capsys):
    """A resume its checkpoint refuses (adapters asked of a full fine-tune) writes nothing: the run
    still says lora_rank=0, so an `lm dpo --init` of it trains the full model, not adapters."""
    from lm.store.meta import init_config

    root, task = base_run
    work = tmp_path / "full"
    assert sft(root, task, work, 2, held_out=False) == 0
    before = {p: p.read_bytes() for p in work.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert sft(root, task, work, 4, "--config.model.lora_rank=8", "--resume", held_out=False) == 2
    err = capsys.readouterr().err
    assert "does not fit this config" in err and "model.lora_rank=0 (checkpoint) vs 8 (now)" in err
    assert {p: p.read_bytes() for p in work.rglob("*") if p.is_file()} == before
    assert init_config(str(work)).model.lora_rank == 0
