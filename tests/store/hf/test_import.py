"""Hugging Face checkpoints in: every architecture variant gives transformers' logits and greedy
tokens, loads sharded exactly as on one device, reads only what each device holds, and refuses
what it cannot honour with one line."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from lm.config import rules_table, with_values  # noqa: E402
from lm.errors import UserError  # noqa: E402
from lm.model.build import build_model  # noqa: E402
from lm.model.spec import ModelSpec  # noqa: E402
from lm.store import safetensors_files  # noqa: E402
from lm.store.hf.config import hf_config  # noqa: E402
from lm.store.hf.reader import lazy_params  # noqa: E402
from tests.hf_models import FAMILIES, VARIANTS, write_model  # noqa: E402

IDS = np.array([[1, 5, 9, 33, 2, 7, 100, 200] * 4, [4, 8, 15, 16, 23, 42, 99, 250] * 4], np.int32)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name in VARIANTS:
        model = write_model(name, root / name)
        with torch.no_grad():
            logits = model(torch.tensor(IDS, dtype=torch.long)).logits.numpy()
        out[name] = (root / name, model, logits)
    return out


def ours(path, mesh=(1, 1, 1), **model_keys):
    sizes = {f"mesh.{axis}": n for axis, n in zip(("data", "fsdp", "tensor"), mesh)}
    config = with_values(hf_config(path), sizes | {f"model.{k}": v for k, v in model_keys.items()})
    n = int(np.prod(mesh))
    built = build_model(config, jax.devices()[:n], rules=rules_table(config))
    return built, built.place(lazy_params(path, built.spec, str(path)))


def logits_of(built, params, ids=IDS):
    seg = jnp.ones(ids.shape, jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    return np.asarray(jax.jit(built.module.apply)({"params": params}, jnp.asarray(ids), seg, pos))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_equal_transformers(models, name):
    path, _, expected = models[name]
    built, params = ours(path)  # the default path: blockwise attention, CPU kernels
    got = logits_of(built, params)
    np.testing.assert_allclose(got, expected, atol=1e-4 * max(1.0, np.abs(expected).max()), rtol=0)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_generation_equals_transformers(models, name):
    from lm.infer.generate import Generator
    from lm.infer.sampling import SamplingParams

    path, model, _ = models[name]
    built, params = ours(path)
    prompts = [IDS[0, :5].tolist(), IDS[1, :11].tolist()]
    gen = Generator(
        built.module,
        params,
        SamplingParams(max_new_tokens=32, temperature=0),
        eos_id=-1,
        max_len=64,
        mesh=built.mesh,
        rules=built.rules,
    )
    got = gen(prompts).ids
    for prompt, ids in zip(prompts, got):
        with torch.no_grad():
            want = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                min_new_tokens=32,
            )[0, len(prompt) :].tolist()
        assert ids.tolist() == want


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_sharded_import_equals_one_device(models, name):
    path = models[name][0]
    one = logits_of(*ours(path))
    built, params = ours(path, mesh=(2, 2, 2))
    wq = params["blocks"]["attn"]["wq"]
    assert wq.sharding.spec == built.param_shardings["blocks"]["attn"]["wq"].spec
    assert len(wq.addressable_shards) == 8 and wq.addressable_shards[0].data.size < wq.size  # not replicated
    np.testing.assert_allclose(logits_of(built, params), one, atol=1e-5 * max(1.0, np.abs(one).max()), rtol=0)


def test_each_device_reads_only_the_rows_it_holds(models, monkeypatch):
    path = models["qwen3"][0]
    read = []
    original = safetensors_files.TensorFiles.read

    def counting(self, name, rows=None):
        out = original(self, name, rows)
        read.append((name, out.nbytes))
        return out

    monkeypatch.setattr(safetensors_files.TensorFiles, "read", counting)
    # vocab -> tensor: each device half of the rows
    config = with_values(hf_config(path), {"mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 2})
    built = build_model(config, jax.devices()[:2], rules=rules_table(config))
    lazy = lazy_params(path, built.spec, str(path))
    placed = built.place(lazy)
    full = 300 * 64 * 4
    assert [n for name, n in read if name == "model.embed_tokens.weight"] == [full // 2] * 2
    # heads -> tensor: each device reads its half of q_proj's rows [heads * head_dim, d]; o_proj [d, heads *
    # head_dim] is split along its inputs there, so its rows are read whole
    assert [n for name, n in read if name == "model.layers.0.self_attn.q_proj.weight"] == [4 * 24 * 64 * 4 // 2] * 2
    assert [n for name, n in read if name == "model.layers.0.self_attn.o_proj.weight"] == [64 * 4 * 24 * 4] * 2
    for leaf in (
        ("blocks", "attn", "wq"),
        ("blocks", "attn", "wo"),
        ("embedding",),
        ("blocks", "mlp", "w_down"),
        ("blocks", "attn", "q_norm", "scale"),
    ):
        want, got = lazy, placed
        for k in leaf:
            want, got = want[k], got[k]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_bf16_checkpoint_stays_bf16_when_frozen(tmp_path):
    write_model("qwen3", tmp_path, dtype="bfloat16")
    config = hf_config(tmp_path)
    built = build_model(config, jax.devices()[:1], rules=rules_table(config))
    lazy = lazy_params(tmp_path, built.spec, str(tmp_path))
    placed = built.place(lazy, "float32")  # a frozen copy "in the compute dtype" is never widened
    assert placed["blocks"]["attn"]["wq"].dtype == jnp.bfloat16
    assert built.place(lazy, "bfloat16")["embedding"].dtype == jnp.bfloat16


def test_unsupported_architectures_and_keys_are_one_line(tmp_path, models):
    from lm.store.hf.reader import load_hf

    path = models["llama3"][0]
    config = json.loads((path / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    for change, pattern in [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({"hidden_act": "gelu"}, "'hidden_act' = 'gelu' is not supported"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "RoPE type 'dynamic'"),
        ({"attention_bias": True}, "'attention_bias' = True"),
    ]:
        (bad / "config.json").write_text(json.dumps(config | change))
        with pytest.raises(UserError, match=pattern):
            hf_config(bad)
    (bad / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 4}))
    with pytest.raises(UserError, match=r"tensor 'model.layers.3.input_layernorm.weight' is missing"):
        lazy_params(bad, ModelSpec.from_config(hf_config(bad).model), "m")
    (bad / "config.json").write_text(json.dumps(config))
    data = (path / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match=r"model.safetensors: tensor '.*' is cut short"):
        load_hf(bad)


@pytest.mark.parametrize("name", FAMILIES)
def test_five_lora_steps_on_an_imported_bf16_checkpoint(tmp_path, name):
    """The base stays frozen in the checkpoint's dtype (bf16) beside float32 adapters, and five
    LoRA steps on a repeated batch lower its loss."""
    from lm.model.lora import is_adapter
    from lm.train.losses import sft_loss
    from lm.train.setup import build_run

    write_model(name, tmp_path, dtype="bfloat16")
    config = with_values(
        hf_config(tmp_path),
        {"model.lora_rank": 4, "model.lora_alpha": 8.0, "optim.lr": 1e-2, "optim.warmup_steps": 0}
        | {"optim.weight_decay": 0.0, "train.batch_size": 2, "train.steps": 5},
    )
    run = build_run(config, sft_loss, devices=jax.devices()[:1], trainable=is_adapter)
    state, frozen = run.init(seed=0, base=lazy_params(tmp_path, run.spec, str(tmp_path)))
    assert frozen["base"]["blocks"]["attn"]["wq"].dtype == jnp.bfloat16
    assert state.params["blocks"]["attn"]["wq_lora_a"].dtype == jnp.float32
    batch = {
        "inputs": IDS,
        "targets": np.roll(IDS, -1, axis=1),
        "segment_ids": np.ones_like(IDS),
        "positions": np.broadcast_to(np.arange(IDS.shape[1], dtype=np.int32), IDS.shape).copy(),
        "loss_mask": np.ones(IDS.shape, np.float32),
    }
    signature = run.signature(2)
    step, placer = run.bind(run.train_step(signature), frozen), run.placer(signature)
    losses = []
    for _ in range(5):
        state, metrics = step(state, placer.from_global(batch))
        losses.append(float(metrics["loss"]))
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
