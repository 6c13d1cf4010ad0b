"""Hugging Face checkpoints out: a model trained here loads in transformers as a Llama (as a
Qwen3 with QK-norm) with our logits, our sentencepiece ids and our chat format; sharded weights
reload; imported Qwen3 and Gemma 2 models go back with the original's logits; LoRA adapters load
in PEFT over their base with our merged model's logits; what cannot be written is refused with
one line."""

import json
import pathlib
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

import flax.linen as nn  # noqa: E402

from lm.cli import main  # noqa: E402
from lm.config import base_config, with_values  # noqa: E402
from lm.data.chat import ChatTemplate  # noqa: E402
from lm.data.spm import CHAT_TOKENS, train_sentencepiece  # noqa: E402
from lm.errors import UserError  # noqa: E402
from lm.model.lora import merge_lora  # noqa: E402
from lm.model.spec import ModelSpec  # noqa: E402
from lm.model.transformer import Transformer, init_params  # noqa: E402
from lm.store.hf.export import export_hf, export_peft  # noqa: E402
from lm.store.hf.reader import load_hf  # noqa: E402
from lm.store.load import load_trained  # noqa: E402
from lm.store.loaded import Loaded  # noqa: E402
from tests.hf_models import FAMILIES, VARIANTS, write_model, write_tokenizer  # noqa: E402

STDLIB = pathlib.Path(sysconfig.get_paths()["stdlib"])
CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": " 4, of course."},
    {"role": "user", "content": " And 3 + 3?"},
]


def stdlib_text(limit: int, skip: int) -> str:
    out, n = [], 0
    for path in sorted(STDLIB.glob("*.py"))[skip:]:
        out.append(path.read_text(encoding="utf-8", errors="replace"))
        n += len(out[-1])
        if n >= limit:
            break
    return "".join(out)[:limit]


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    docs = [p.read_text(encoding="utf-8") for p in sorted(STDLIB.glob("*.py"))[:30]]
    return train_sentencepiece(docs, tmp_path_factory.mktemp("spm") / "tok", vocab_size=800)


def tiny_config(vocab: int, **model):
    c = base_config()
    c.model.update(
        dict(
            vocab_size=vocab,
            d_model=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            d_ff=96,
            max_seq_len=64,
            tie_embeddings=False,
            init_std=0.1,
        )
        | model
    )
    return c


def random_params(config, seed: int = 0) -> dict:
    """Our init, with norm scales and LoRA B away from their init (a mis-mapped one shows)."""
    params = nn.unbox(init_params(Transformer(ModelSpec.from_config(config.model)), jax.random.PRNGKey(seed)))
    rng = np.random.default_rng(seed)
    bump = lambda path, x: (
        np.asarray(x)
        + (
            rng.normal(0, 0.2, x.shape).astype(np.float32)
            if ("scale" in str(path[-1]) or "lora_b" in str(path[-1]))
            else 0
        )
    )
    return jax.tree_util.tree_map_with_path(bump, params)


def our_logits(config, params, ids):
    spec = ModelSpec.from_config(config.model)
    ids = jnp.asarray(ids)
    pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    params = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), params)
    return np.asarray(Transformer(spec).apply({"params": params}, ids, jnp.ones_like(ids), pos))


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids), dtype=torch.long)).logits.float().numpy()


def close(got, want):
    np.testing.assert_allclose(got, want, atol=1e-4 * max(1.0, float(np.abs(want).max())), rtol=0)


def ids_for(vocab: int, seed: int = 0):
    return np.random.default_rng(seed).integers(0, vocab, (2, 24))


@pytest.fixture(scope="module")
def trained(spm, tmp_path_factory):
    """A tiny model trained here (random params), exported as a Hugging Face directory."""
    config = tiny_config(spm.vocab_size)
    config.data.tokenizer = str(spm.path)
    params = random_params(config)
    out = tmp_path_factory.mktemp("hf") / "llama"
    done = export_hf(Loaded(config, params, spm, "test model"), out)
    return config, params, out, done


def test_trained_model_loads_as_llama_with_our_logits(trained, spm):
    config, params, out, done = trained
    assert done["architecture"] == "LlamaForCausalLM" and done["files"] == ["model.safetensors"]
    hf = json.loads((out / "config.json").read_text())
    assert hf["model_type"] == "llama" and hf["torch_dtype"] == "float32" and hf["eos_token_id"] == 2
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    ids = ids_for(config.model.vocab_size)
    close(hf_logits(model, ids), our_logits(config, params, ids))
    generation = json.loads((out / "generation_config.json").read_text())
    end = spm.special_id("<|end|>")  # the chat template's end of turn
    assert generation["eos_token_id"] == [2, end] and generation["bos_token_id"] == 1
    assert generation["pad_token_id"] == 3


def test_trained_model_with_qk_norm_loads_as_qwen3(spm, tmp_path):
    config = tiny_config(spm.vocab_size, qk_norm=True, tie_embeddings=True)
    params = random_params(config, seed=2)  # the q/k norm scales bumped apart: a swap shows
    done = export_hf(Loaded(config, params, spm, "test model"), tmp_path / "qwen3")
    hf = json.loads((tmp_path / "qwen3" / "config.json").read_text())
    assert done["architecture"] == "Qwen3ForCausalLM" and hf["model_type"] == "qwen3"
    assert hf["head_dim"] == 16 and hf["attention_bias"] is False and hf["tie_word_embeddings"] is True
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "qwen3", dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3ForCausalLM"
    ids = ids_for(config.model.vocab_size, 2)
    close(hf_logits(model, ids), our_logits(config, params, ids))
    back = load_hf(tmp_path / "qwen3")  # and back: the same logits as a Qwen3 import
    assert back.config.model.family == "qwen3" and back.config.model.qk_norm
    close(our_logits(back.config, back.params, ids), our_logits(config, params, ids))


def test_tokenizer_gives_our_ids(trained, spm):
    out = trained[2]
    hf = transformers.AutoTokenizer.from_pretrained(out)
    text = stdlib_text(200_000, skip=120)  # modules the tokenizer was not trained on
    for special in ("<s>", "</s>", "<pad>", "<unk>", *CHAT_TOKENS, "\u2581"):
        assert special not in text  # HF would read these as their tokens (see lm.store.hf.tokenizer)
    ids = hf(text, add_special_tokens=True)["input_ids"]
    ours = spm.encode(text)
    assert len(ours) > 40_000
    np.testing.assert_array_equal(ids, ours)
    assert hf.decode(ids) == text
    samples = ["héllo wörld — 中文 🎉\r\n", "  \t x = 12345\n\n", " leading", "trailing  ", "a  b   c"]
    for sample in samples:
        np.testing.assert_array_equal(hf(sample)["input_ids"], spm.encode(sample))
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (spm.bos_id, spm.eos_id, spm.pad_id)


def test_chat_template_renders_our_format(trained, spm):
    out = trained[2]
    hf = transformers.AutoTokenizer.from_pretrained(out)
    text = hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<s><|system|>\nYou answer briefly.<|end|>\n<|user|>\nWhat is 2 + 2?<|end|>\n"
        "<|assistant|>\n 4, of course.<|end|>\n<|user|>\n And 3 + 3?<|end|>\n<|assistant|>\n"
    )
    ours = ChatTemplate.for_tokenizer(spm)
    ids = hf.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids == ours.prompt(CHAT).tolist()  # here no piece spans a role's newline and its content
    np.testing.assert_array_equal(hf.apply_chat_template(CHAT[:3], return_dict=False), ours.render(CHAT[:3])[0])
    assert (
        hf.decode(ids, skip_special_tokens=True) == "\nYou answer briefly.\n\nWhat is 2 + 2?\n\n 4, of course."
        "\n\n And 3 + 3?\n\n"
    )


def test_sharded_export_reloads(spm, tmp_path):
    config = tiny_config(spm.vocab_size, tie_embeddings=True)
    params = random_params(config, seed=1)
    out = tmp_path / "sharded"
    done = export_hf(Loaded(config, params, spm, "test model"), out, max_bytes=60_000)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 3 and done["files"][-1] == "model.safetensors.index.json"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards) and "lm_head.weight" not in index["weight_map"]
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = ids_for(config.model.vocab_size, 1)
    close(hf_logits(model, ids), our_logits(config, params, ids))


def test_bfloat16_export(trained, tmp_path, spm):
    config, params = trained[:2]
    out = tmp_path / "bf16"
    export_hf(Loaded(config, params, spm, "test model"), out, dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = ids_for(config.model.vocab_size)
    want = our_logits(config, params, ids)
    np.testing.assert_allclose(hf_logits(model, ids), want, atol=0.05 * np.abs(want).max())


CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def imported(name: str, root: pathlib.Path):
    """A random transformers model of a family with a tokenizer whose chat template ends turns
    with <|im_end|> (id 299): (directory, torch model)."""
    path = root / name
    model = write_model(name, path, seed=3)
    write_tokenizer(path)
    tok_json = json.loads((path / "tokenizer.json").read_text())
    tok_json["model"]["vocab"] |= {"<|im_start|>": 298, "<|im_end|>": 299}
    del tok_json["model"]["vocab"]["w298"], tok_json["model"]["vocab"]["w299"]
    tok_json["added_tokens"] += [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, t in ((298, "<|im_start|>"), (299, "<|im_end|>"))
    ]
    (path / "tokenizer.json").write_text(json.dumps(tok_json))
    (path / "chat_template.jinja").write_text(CHATML)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1, "temperature": 0.7}))
    return path, model


@pytest.mark.parametrize("name", list(VARIANTS))
def test_imported_model_goes_back_with_its_logits(name, tmp_path):
    path, original = imported(name, tmp_path)
    out = tmp_path / "out"
    done = export_hf(load_hf(path), out)
    assert done["architecture"] == type(original).__name__
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = ids_for(300, 2)
    close(hf_logits(reloaded, ids), hf_logits(original, ids))
    assert (out / "tokenizer.json").read_bytes() == (path / "tokenizer.json").read_bytes()
    assert (out / "chat_template.jinja").read_text() == CHATML
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, 299] and generation["temperature"] == 0.7


@pytest.mark.parametrize("name", FAMILIES)
def test_adapters_on_an_imported_model_load_in_peft(name, tmp_path):
    """Every family's projections carry adapters under PEFT's names: transformers + peft over the
    original checkpoint give the logits of our model with the same adapters."""
    from peft import PeftModel

    path, original = imported(name, tmp_path)
    loaded = load_hf(path)
    config = with_values(loaded.config, {"model.lora_rank": 4, "model.lora_alpha": 8.0})
    adapters = random_params(config, seed=5)
    adapters["blocks"] = {m: {k: v for k, v in sub.items() if "_lora_" in k} for m, sub in adapters["blocks"].items()}
    adapters = {"blocks": {m: sub for m, sub in adapters["blocks"].items() if sub}}
    base = jax.tree.map(np.asarray, loaded.params)
    params = {k: v for k, v in base.items() if k != "blocks"}
    params["blocks"] = {m: sub | adapters["blocks"].get(m, {}) for m, sub in base["blocks"].items()}
    export_peft(Loaded(config, params, loaded.tokenizer, "lora"), tmp_path / "adapter")
    ids = ids_for(300, 4)
    want = our_logits(config, params, ids)
    assert np.abs(want - hf_logits(original, ids)).max() > 1e-2  # the adapters change the logits
    close(hf_logits(PeftModel.from_pretrained(original, tmp_path / "adapter").eval(), ids), want)


def test_import_verb_and_export_from_params(tmp_path, capsys):
    path, original = imported("qwen3", tmp_path)
    export = tmp_path / "qwen3.safetensors"
    assert main(["import", "hf", str(path), "--out", str(export)]) == 0
    assert (tmp_path / "qwen3.tokenizer" / "tokenizer.json").is_file()
    loaded = load_trained(params=str(export))
    assert loaded.config.model.family == "qwen3" and loaded.tokenizer.stop_ids == (1,)
    ids = ids_for(300, 4)
    close(our_logits(loaded.config, loaded.params, ids), hf_logits(original, ids))
    out = tmp_path / "back"
    assert main(["export", "--params", str(export), "--format", "hf", "--out", str(out)]) == 0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    close(hf_logits(reloaded, ids), hf_logits(original, ids))
    assert main(["import", "hf", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2
    assert f"'{tmp_path / 'nothing'}' is not a Hugging Face model directory" in capsys.readouterr().err


@pytest.fixture(scope="module")
def lora(spm, tmp_path_factory):
    """A LoRA model trained here: base and nonzero adapters on every projection, exported as a
    Hugging Face base and a PEFT adapter."""
    config = tiny_config(spm.vocab_size, lora_rank=4, lora_alpha=8.0)
    config.data.tokenizer = str(spm.path)
    params = random_params(config, seed=2)
    root = tmp_path_factory.mktemp("peft")
    base_config_ = tiny_config(spm.vocab_size)
    base = {k: v for k, v in params.items() if k != "blocks"}
    base["blocks"] = {m: {k: v for k, v in sub.items() if "_lora_" not in k} for m, sub in params["blocks"].items()}
    export_hf(Loaded(base_config_, base, spm, "base"), root / "base")
    done = export_peft(Loaded(config, params, spm, "lora"), root / "adapter")
    return config, params, root, done


def test_peft_adapter_gives_our_merged_logits(lora):
    from peft import PeftModel

    config, params, root, done = lora
    assert done["targets"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    adapter = json.loads((root / "adapter" / "adapter_config.json").read_text())
    assert (adapter["peft_type"], adapter["r"], adapter["lora_alpha"]) == ("LORA", 4, 8)
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32).eval()
    ids = ids_for(config.model.vocab_size, 5)
    plain = with_values(config, {"model.lora_rank": 0})
    merged = our_logits(plain, merge_lora(params, 8.0, 4), ids)
    assert np.abs(merged - hf_logits(base, ids)).max() > 1e-2  # the adapters change the logits
    model = PeftModel.from_pretrained(base, root / "adapter").eval()
    close(hf_logits(model, ids), merged)


def test_merged_lora_export(lora, tmp_path, spm):
    config, params, root, _ = lora
    with pytest.raises(UserError, match=r"holds LoRA adapters \(model.lora_rank=4\): add --merge"):
        export_hf(Loaded(config, params, spm, "lora"), tmp_path / "refused")
    export_hf(Loaded(config, params, spm, "lora"), tmp_path / "merged", merge=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = ids_for(config.model.vocab_size, 6)
    plain = with_values(config, {"model.lora_rank": 0})
    close(hf_logits(model, ids), our_logits(plain, merge_lora(params, 8.0, 4), ids))


def test_refusals_name_the_key(spm, tmp_path):
    config = tiny_config(spm.vocab_size, mlp="gelu")
    params = random_params(config)
    with pytest.raises(UserError, match=r"cannot be written as a Hugging Face Llama checkpoint: model.mlp='gelu'"):
        export_hf(Loaded(config, params, spm, "gelu model"), tmp_path / "gelu")
    plain = tiny_config(spm.vocab_size)
    with pytest.raises(UserError, match=r"no LoRA adapters \(model.lora_rank=0\)"):
        export_peft(Loaded(plain, random_params(plain), spm, "plain"), tmp_path / "peft")
    extra = random_params(plain) | {"scalar_head": {"w": np.zeros((64, 1), np.float32)}}
    with pytest.raises(UserError, match=r"params 'scalar_head/w' have no place"):
        export_hf(Loaded(plain, extra, spm, "reward model"), tmp_path / "reward")


def test_export_verb_writes_peft_and_merged_from_params(lora, spm, tmp_path, capsys):
    from safetensors.numpy import load_file

    from lm.store.export import export_loaded

    config, params, root, _ = lora
    export = tmp_path / "lora.safetensors"  # our layout: base and adapters, config with lora_rank=4
    export_loaded(Loaded(config, params, spm, "lora"), export)
    run = lambda *args: main(["export", "--params", str(export), *args])
    assert run("--format", "hf", "--out", str(tmp_path / "refused")) == 2
    assert "holds LoRA adapters (model.lora_rank=4): add --merge" in capsys.readouterr().err
    assert run("--format", "peft", "--out", str(tmp_path / "adapter")) == 0
    got, want = (
        load_file(tmp_path / "adapter" / "adapter_model.safetensors"),
        load_file(root / "adapter" / "adapter_model.safetensors"),
    )
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)
    assert run("--format", "hf", "--merge", "--shard-size", "100KB", "--out", str(tmp_path / "merged")) == 0
    assert (tmp_path / "merged" / "model.safetensors.index.json").is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = ids_for(config.model.vocab_size, 7)
    plain = with_values(config, {"model.lora_rank": 0})
    close(hf_logits(model, ids), our_logits(plain, merge_lora(params, 8.0, 4), ids))
    assert run("--format", "safetensors", "--dtype", "bfloat16", "--out", str(tmp_path / "x.safetensors")) == 2
    assert "--dtype applies to --format hf and peft" in capsys.readouterr().err


def test_byte_tokenizer_export(tmp_path):
    from lm.data.tokenizer import ByteTokenizer
    from lm.store.hf.tokenizer import write_tokenizer

    tok = ByteTokenizer()
    assert write_tokenizer(tok, tmp_path, 64).eos == (257,)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "héllo wörld — 中文 🎉\r\n\t x = 1"
    assert hf(text)["input_ids"] == tok.encode(text).tolist() and hf.decode(hf(text)["input_ids"]) == text
    chat = CHAT[1:3]
    assert hf.apply_chat_template(chat, return_dict=False) == ChatTemplate.for_tokenizer(tok).render(chat)[0].tolist()
