"""The demo's last stage: a run exported as a Hugging Face checkpoint answers as `lm sample` does."""

import pytest

pytest.importorskip("transformers")

from lm.cli import main  # noqa: E402
from lm.data.synthetic import write_sort_task  # noqa: E402
from tests.e2e.test_cli_sft import SFT  # noqa: E402


def test_exported_run_answers_as_lm_sample(small_base, tmp_path):
    from lm.demo.pipeline import export_and_reload

    task = write_sort_task(tmp_path / "task", n_train=200, n_heldout=8)
    work = tmp_path / "sft"
    assert (
        main(
            [
                "sft",
                "--init",
                str(small_base),
                "--data",
                str(task["train"]),
                "--workdir",
                str(work),
                "--config.train.steps=20",
                *SFT,
            ]
        )
        == 0
    )
    out = export_and_reload(work, tmp_path / "hf", task["heldout"], n=8)
    assert out["architecture"] == "Qwen3ForCausalLM" and out["n"] == 8  # the default recipe has QK-norm
    assert out["same_prompt_ids"] == 8  # the byte tokenizer: the rendered chat tokenizes as ours
    assert out["same_answers"] == 8
