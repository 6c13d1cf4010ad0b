"""A run fine-tuned from a Hugging Face directory keeps the tokenizer it trained with: the HF
tokenizer files and chat template in WORKDIR/tokenizer/, data.tokenizer naming them. `lm sample`
of the run answers greedily as transformers does with the same adapted model (full SFT and DPO
exported with --format hf, LoRA through peft over the base and exported --merge); every export
carries the HF tokenizer (checked with the `tokenizers` and `transformers` libraries); a run
started from such a run carries it on; --tokenizer is accepted when it is the run's own."""

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

from lm.cli import main  # noqa: E402
from lm.data.synthetic import write_sort_pairs, write_sort_task  # noqa: E402
from lm.errors import UserError  # noqa: E402
from tests.hf_models import write_model  # noqa: E402
from tests.hf_tokenizers import qwen_like  # noqa: E402

STEPS = [
    "--config.train.steps=2",
    "--config.optim.lr=1e-3",
    "--config.optim.warmup_steps=0",
    "--config.train.batch_size=8",
    "--config.train.peak_flops=1e11",
    "--config.data.seq_len=96",
    "--config.checkpoint.every_steps=2",
    "--no-progress",
]
PROMPT = "sort 70931"
NEW = 6
TEXTS = ["sort 70931", "def f(x):\n    return x  # ünïcode", "<|im_start|>user\nhi<|im_end|>\n"]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A tiny random Qwen3 (2 layers) with a Qwen2.5-like byte-level tokenizer and ChatML template."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("qwen3") / "model"
    qwen_like(path)
    stops = (path / "generation_config.json").read_text()
    write_model("qwen3", path, vocab_size=len(AutoTokenizer.from_pretrained(path)), num_hidden_layers=2)
    (path / "generation_config.json").write_text(stops)  # the tokenizer's stop ids over the model's
    return path


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("sort")
    return write_sort_task(root, n_train=32, n_heldout=4) | {"pairs": write_sort_pairs(root, 32, 4)["train"]}


@pytest.fixture(scope="module")
def full_sft(hf, task, tmp_path_factory):
    work = tmp_path_factory.mktemp("full") / "sft"
    assert (
        main(
            [
                "sft",
                "--init",
                str(hf),
                "--data",
                str(task["train"]),
                "--workdir",
                str(work),
                "--config.finetune.epochs=0",
                *STEPS,
            ]
        )
        == 0
    )
    return work


def _keeps_hf_tokenizer(work, hf):
    """The run's config names the HF tokenizer and the run holds its files."""
    config = json.loads((work / "config.json").read_text())
    assert config["data"]["tokenizer"] != "byte" and config["data"]["tokenizer"] == str(hf.absolute())
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (work / "tokenizer" / name).read_bytes() == (hf / name).read_bytes()


def _sampled(work, tmp_path) -> list[int]:
    """`lm sample --workdir RUN --chat` greedy: the ids it answers PROMPT with."""
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n")
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
                str(NEW),
            ]
        )
        == 0
    )
    return json.loads(out.read_text())["tokens"]


def _greedy(model, tokenizer_dir) -> tuple[list[int], set]:
    """transformers alone: PROMPT rendered by the tokenizer's chat template, NEW greedy ids (no
    stopping), and the stop ids of its generation_config."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in transformers 5
    out = []
    with torch.no_grad():
        for _ in range(NEW):
            logits = model(torch.tensor([ids + out], dtype=torch.long)).logits[0, -1]
            out.append(int(torch.argmax(logits)))
    stops = json.loads((tokenizer_dir / "generation_config.json").read_text())["eos_token_id"]
    return out, set(stops if isinstance(stops, list) else [stops])


def _same_answer(ours: list[int], theirs: list[int], stops: set) -> None:
    """Our greedy ids are transformers' up to where ours stopped (at a stop id, or after NEW)."""
    assert ours == theirs[: len(ours)], (ours, theirs)
    assert len(ours) == NEW or (ours and ours[-1] in stops) or theirs[len(ours)] in stops, (ours, theirs)


def _exported_tokenizer_is_hf(out, hf, vocab: int) -> None:
    """OUT's tokenizer.json and tokenizer files give the HF tokenizer's ids, read by `tokenizers`
    and by transformers; its chat template renders as the HF directory's."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    exported, original = Tokenizer.from_file(str(out / "tokenizer.json")), AutoTokenizer.from_pretrained(hf)
    auto = AutoTokenizer.from_pretrained(out)
    assert exported.get_vocab_size(with_added_tokens=True) == len(original) == vocab
    for text in TEXTS:
        want = original(text, add_special_tokens=False)["input_ids"]
        assert exported.encode(text, add_special_tokens=False).ids == want
        assert auto(text, add_special_tokens=False)["input_ids"] == want
    chat = [{"role": "user", "content": PROMPT}]
    assert auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == original.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )


def test_full_sft_keeps_the_tokenizer_and_answers_as_transformers(hf, full_sft, tmp_path):
    from transformers import AutoModelForCausalLM

    _keeps_hf_tokenizer(full_sft, hf)
    ours = _sampled(full_sft, tmp_path)
    out = tmp_path / "hf"
    assert main(["export", "--workdir", str(full_sft), "--format", "hf", "--out", str(out)]) == 0
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    _exported_tokenizer_is_hf(out, hf, vocab)
    theirs, stops = _greedy(AutoModelForCausalLM.from_pretrained(out).eval(), out)
    _same_answer(ours, theirs, stops)


def test_our_exports_of_the_run_carry_the_tokenizer(hf, full_sft, tmp_path):
    from lm.store.load import load_trained

    want = load_trained(params=str(hf)).tokenizer.fingerprint()
    assert main(["export", "--workdir", str(full_sft), "--out", str(tmp_path / "orbax")]) == 0
    assert main(["export", "--workdir", str(full_sft), "--out", str(tmp_path / "m.safetensors")]) == 0
    assert (tmp_path / "orbax" / "tokenizer" / "tokenizer.json").is_file()
    assert (tmp_path / "m.tokenizer" / "tokenizer.json").is_file()
    for params in (tmp_path / "orbax", tmp_path / "m.safetensors"):
        assert load_trained(params=str(params)).tokenizer.fingerprint() == want


def test_tokenizer_given_is_accepted_when_it_is_the_runs_own(hf, full_sft):
    from lm.store.load import load_trained

    want = load_trained(params=str(hf)).tokenizer.fingerprint()
    for given in (str(hf), str(hf / "tokenizer.json"), str(full_sft / "tokenizer")):
        assert load_trained(workdir=str(full_sft), tokenizer=given).tokenizer.fingerprint() == want
    with pytest.raises(UserError, match="does not match the tokenizer of"):
        load_trained(workdir=str(full_sft), tokenizer="byte")


def test_a_run_started_from_the_run_carries_the_tokenizer_on(hf, full_sft, task, tmp_path):
    """`lm sft --init RUN` where RUN was fine-tuned from an HF directory: the same tokenizer files,
    data.tokenizer naming the tokenizer kept in RUN."""
    from lm.store.load import load_trained

    work = tmp_path / "again"
    assert (
        main(
            [
                "sft",
                "--init",
                str(full_sft),
                "--data",
                str(task["train"]),
                "--workdir",
                str(work),
                "--config.finetune.epochs=0",
                *STEPS,
                "--config.train.steps=1",
            ]
        )
        == 0
    )
    config = json.loads((work / "config.json").read_text())
    assert config["data"]["tokenizer"] == str((full_sft / "tokenizer").absolute())
    assert (work / "tokenizer" / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    assert (
        load_trained(workdir=str(work)).tokenizer.fingerprint() == load_trained(params=str(hf)).tokenizer.fingerprint()
    )


def test_lora_sft_answers_as_peft_over_the_base_and_its_exports_carry_the_tokenizer(hf, task, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    work = tmp_path / "lora"
    assert (
        main(
            [
                "sft",
                "--init",
                str(hf),
                "--data",
                str(task["train"]),
                "--workdir",
                str(work),
                "--config.finetune.epochs=0",
                "--config.model.lora_rank=4",
                *STEPS,
                "--config.optim.lr=1e-2",
            ]
        )
        == 0
    )
    _keeps_hf_tokenizer(work, hf)
    ours = _sampled(work, tmp_path)
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert main(["export", "--workdir", str(work), "--format", "peft", "--out", str(adapter)]) == 0
    assert main(["export", "--workdir", str(work), "--format", "hf", "--merge", "--out", str(merged)]) == 0
    vocab = json.loads((merged / "config.json").read_text())["vocab_size"]
    _exported_tokenizer_is_hf(adapter, hf, vocab)
    _exported_tokenizer_is_hf(merged, hf, vocab)
    with torch.no_grad():
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf), adapter).eval()
    theirs, stops = _greedy(peft, adapter)
    _same_answer(ours, theirs, stops)
    assert _greedy(AutoModelForCausalLM.from_pretrained(merged).eval(), merged)[0] == theirs


def test_dpo_keeps_the_tokenizer_and_answers_as_transformers(hf, task, tmp_path):
    from transformers import AutoModelForCausalLM

    work = tmp_path / "dpo"
    assert (
        main(
            [
                "dpo",
                "--init",
                str(hf),
                "--data",
                str(task["pairs"]),
                "--workdir",
                str(work),
                "--config.finetune.epochs=0",
                *STEPS,
            ]
        )
        == 0
    )
    _keeps_hf_tokenizer(work, hf)
    ours = _sampled(work, tmp_path)
    out = tmp_path / "hf"
    assert main(["export", "--workdir", str(work), "--format", "hf", "--out", str(out)]) == 0
    _exported_tokenizer_is_hf(out, hf, json.loads((out / "config.json").read_text())["vocab_size"])
    theirs, stops = _greedy(AutoModelForCausalLM.from_pretrained(out).eval(), out)
    _same_answer(ours, theirs, stops)


def test_a_run_written_without_its_tokenizer_uses_its_init_models(hf, full_sft):
    """A run whose config says 'byte' and that keeps no tokenizer, though it started from an HF
    directory (as fine-tuning runs were once written), reads its init model's tokenizer; a wrong
    --tokenizer is still refused."""
    from lm.store.load import load_trained
    from lm.store.meta import config_from, tokenizer_for

    saved = json.loads((full_sft / "config.json").read_text())
    saved["data"]["tokenizer"] = "byte"
    config = config_from(saved, "an old run")
    want = load_trained(params=str(hf)).tokenizer
    for given in (None, str(hf)):
        tok = tokenizer_for(config, None, given, "an old run")
        assert tok.fingerprint() == want.fingerprint()
        np.testing.assert_equal(tok.encode(PROMPT), want.encode(PROMPT))
    with pytest.raises(UserError, match="does not match the tokenizer of an old run"):
        tokenizer_for(config, None, "byte", "an old run")
