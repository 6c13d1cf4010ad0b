"""A Hugging Face checkpoint through the stages: continued pretraining (`lm train --init`), LoRA
SFT with the model's own tokenizer and chat template, sampling and evaluation from the result."""

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from lm.cli import main  # noqa: E402
from lm.data.synthetic import write_sort_task  # noqa: E402
from tests.hf_models import write_model  # noqa: E402
from tests.hf_tokenizers import qwen_like  # noqa: E402

SMALL = [
    "--config.train.batch_size=8",
    "--config.eval.batches=1",
    "--config.eval.batch_size=8",
    "--config.train.peak_flops=1e11",
    "--no-progress",
    "--config.data.seq_len=64",
]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A tiny random Qwen3 with a Qwen2.5-like byte-level tokenizer and ChatML template."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("qwen3") / "model"
    qwen_like(path)
    write_model("qwen3", path, vocab_size=len(AutoTokenizer.from_pretrained(path)))
    qwen_like(path)  # its generation_config.json (the stop ids) over the model's
    return path


def test_continued_pretraining_starts_from_the_checkpoint(qwen, corpus, tmp_path):
    work = tmp_path / "cpt"
    assert (
        main(
            [
                "train",
                "--init",
                str(qwen),
                "--workdir",
                str(work),
                f"--config.data.corpus={corpus}",
                "--config.data.curate=false",
                "--config.data.heldout_fraction=0.2",
                "--config.train.steps=3",
                "--config.eval.every_steps=3",
                "--config.train.sample_tokens=8",
                *SMALL,
            ]
        )
        == 0
    )
    config = json.loads((work / "config.json").read_text())
    assert (
        config["model"]["family"] == "qwen3" and config["model"]["qk_norm"] and config["data"]["tokenizer"] == str(qwen)
    )
    rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if r.get("step") == 0 and "eval_loss" in r)
    assert np.isfinite(first["eval_loss"])
    summary = json.loads((work / "summary.json").read_text())
    assert summary["step"] == 3


def test_lora_sft_with_the_models_chat_template(qwen, tmp_path):
    task = write_sort_task(tmp_path / "task", n_train=64, n_heldout=8)
    work = tmp_path / "sft"
    assert (
        main(
            [
                "sft",
                "--init",
                str(qwen),
                "--data",
                str(task["train"]),
                "--eval-data",
                str(task["heldout"]),
                "--workdir",
                str(work),
                "--config.train.steps=5",
                "--config.model.lora_rank=4",
                "--config.finetune.epochs=0",
                "--config.eval.every_steps=5",
                "--config.checkpoint.every_steps=5",
                "--config.finetune.eval_examples=4",
                "--config.finetune.eval_max_new_tokens=4",
                *SMALL,
                "--config.data.seq_len=128",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses and all(np.isfinite(losses))
    # the model's own template: ChatML markers in the rendered training text
    from lm.data.chat import ChatTemplate
    from lm.data.tokenizer import load_tokenizer

    tok = load_tokenizer(str(qwen))
    template = ChatTemplate.for_tokenizer(tok)
    ids, weights = template.render([{"role": "user", "content": "sort 312"}, {"role": "assistant", "content": "123"}])
    text = tok.decode(ids[weights > 0])
    assert "123" in text and "user" not in text
    out = tmp_path / "out.jsonl"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "sort 4321"}) + "\n")
    assert (
        main(
            [
                "sample",
                "--workdir",
                str(work),
                "--chat",
                "--prompts",
                str(prompts),
                "--out",
                str(out),
                "--temperature",
                "0",
                "--max-new-tokens",
                "4",
            ]
        )
        == 0
    )
    assert json.loads(out.read_text())["finish_reason"] in ("eos", "length", "stop")
    # the adapters, exported for PEFT over the original checkpoint, give our merged model's logits
    import jax
    import jax.numpy as jnp
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lm.config import rules_table
    from lm.model.build import build_model
    from lm.store.load import load_trained

    assert main(["export", "--workdir", str(work), "--format", "peft", "--out", str(tmp_path / "adapter")]) == 0
    ids = np.asarray([template.prompt([{"role": "user", "content": "sort 4321"}])], np.int32)
    with torch.no_grad():
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(qwen), tmp_path / "adapter").eval()
        want = peft(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    loaded = load_trained(workdir=str(work))
    built = build_model(loaded.config, jax.devices()[:1], rules=rules_table(loaded.config))
    seg, pos = jnp.ones(ids.shape, jnp.int32), jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
    got = np.asarray(built.module.apply({"params": built.place(loaded.params)}, jnp.asarray(ids), seg, pos))
    np.testing.assert_allclose(got, want, atol=1e-4 * max(1.0, np.abs(want).max()), rtol=0)
