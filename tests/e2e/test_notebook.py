"""The quickstart notebook runs top to bottom, so it never rots."""

import os
import pathlib
import re

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = pathlib.Path(__file__).resolve().parents[2] / "notebooks" / "quickstart.ipynb"


@pytest.mark.slow
def test_quickstart_notebook_runs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = dict(os.environ)  # one CPU device, as a user's laptop: drop the suite's simulated devices
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).strip()
    client = NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    )
    client.execute(env=env)
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the loss plot, inline
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "eval_loss" in text and "--- sample" in text
    assert "exact_match_init" in text  # the SFT cell ran to its report
    assert "accuracies" in text  # and the DPO cell to its held-out pair metrics
    assert "eval_reward" in text  # and the RL cell to its held-out rewards
    assert "B - A" in text and "found in the training data: 0 of 32" in text  # and the evaluation cell
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 2  # the loss plot and rl.png
