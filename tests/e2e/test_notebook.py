"""The notebooks run top to bottom, so they never rot: the quickstart (pretrain, loss curve,
sample) and the post-training tour (SFT, DPO, GRPO, distillation, evaluation, HF export)."""

import os
import pathlib
import re

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[2] / "notebooks"


def run(name: str) -> tuple[list, str]:
    """Executes notebooks/NAME.ipynb as a user's laptop would: one CPU device and XLA's default
    optimisation (the suite's fast-compile flags make a few hundred steps twice as slow)."""
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    env = dict(os.environ)
    env["XLA_FLAGS"] = re.sub(r"--xla_\S+", "", env.get("XLA_FLAGS", "")).strip()
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute(env=env)
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    return outputs, text


def images(outputs) -> int:
    return sum("image/png" in o.get("data", {}) for o in outputs)


@pytest.mark.slow
def test_quickstart_notebook_runs():
    outputs, text = run("quickstart")
    assert images(outputs) == 1  # the loss curve, inline
    assert "eval_loss" in text and text.count("--- sample ---") == 4  # the run's own, then three prompts


@pytest.mark.slow
def test_post_training_notebook_runs():
    outputs, text = run("post_training")
    assert "exact_match_init" in text  # the SFT cell ran to its report
    assert "accuracies" in text  # and the DPO cell to its held-out pair metrics
    assert "eval_reward" in text  # and the RL cell to its held-out rewards
    assert "eval_top1_agreement" in text  # and distillation
    assert "B - A" in text and "found in the training data: 0 of 32" in text  # and the evaluation cell
    assert "same_answers" in text  # and transformers answered as lm did
    assert images(outputs) == 1  # rl.png
