"""Mixtral and Qwen3-MoE checkpoints: imported, they give transformers' logits (Qwen3-MoE with and
without renormalised top-k weights), from the per-expert tensors transformers writes or the fused
ones it holds in memory; exported, transformers loads them with the same logits; a model trained
here with experts goes out as Mixtral (with QK-norm as Qwen3-MoE); what cannot be honoured is
refused naming the key."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import flax.linen as nn  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from lm.config import base_config, rules_table, with_values  # noqa: E402
from lm.data.tokenizer import ByteTokenizer  # noqa: E402
from lm.errors import UserError  # noqa: E402
from lm.model.build import build_model  # noqa: E402
from lm.model.spec import ModelSpec  # noqa: E402
from lm.model.transformer import Transformer, init_params  # noqa: E402
from lm.store.hf.config import hf_config  # noqa: E402
from lm.store.hf.export import export_hf  # noqa: E402
from lm.store.hf.reader import lazy_params, load_hf  # noqa: E402
from lm.store.loaded import Loaded  # noqa: E402
from tests.hf_models import MOE_SHAPE, MOE_VARIANTS, write_model, write_tokenizer  # noqa: E402

VOCAB = MOE_SHAPE["vocab_size"]
IDS = np.random.default_rng(0).integers(0, VOCAB, (2, 24)).astype(np.int32)
# name -> what its config.json becomes in our model section
EXPECTED = {
    "mixtral": dict(
        family="mixtral",
        n_experts=4,
        experts_per_token=2,
        expert_d_ff=96,
        router_norm=True,
        qk_norm=False,
        sliding_window=8,
        layer_types=("local", "local"),
    ),
    "qwen3_moe": dict(
        family="qwen3_moe",
        n_experts=4,
        experts_per_token=2,
        expert_d_ff=48,
        router_norm=True,
        qk_norm=True,
        head_dim=24,
        layer_types=(),
    ),
    "qwen3_moe-unnormed": dict(
        family="qwen3_moe",
        n_experts=4,
        experts_per_token=2,
        expert_d_ff=48,
        router_norm=False,
        qk_norm=True,
        tie_embeddings=True,
        sliding_window=8,
        layer_types=("local", "local"),
    ),
}


def hf_logits(model, ids=IDS):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids), dtype=torch.long)).logits.float().numpy()


def router_margin(model, ids=IDS) -> float:
    """The smallest gap, over tokens and layers, between the k-th and (k+1)-th router probability:
    a near tie would let float rounding pick other experts here than there."""
    k = model.config.num_experts_per_tok
    with torch.no_grad():
        layers = model(torch.tensor(ids, dtype=torch.long), output_router_logits=True).router_logits
    probs = [torch.softmax(x.float(), -1).sort(-1, descending=True).values for x in layers]
    return min(float((p[:, k - 1] - p[:, k]).min()) for p in probs)


def close(got, want):
    np.testing.assert_allclose(got, want, atol=1e-4 * max(1.0, float(np.abs(want).max())), rtol=0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for name in MOE_VARIANTS:
        model = write_model(name, root / name)
        write_tokenizer(root / name, VOCAB)
        out[name] = (root / name, model, hf_logits(model))
    return out


def our_logits(path):
    config = hf_config(path)
    built = build_model(config, jax.devices()[:1], rules=rules_table(config))
    params = built.place(lazy_params(path, built.spec, str(path)))
    seg = jnp.ones(IDS.shape, jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(IDS.shape[1], dtype=jnp.int32), IDS.shape)
    return np.asarray(jax.jit(built.module.apply)({"params": params}, jnp.asarray(IDS), seg, pos))


@pytest.mark.parametrize("name", list(MOE_VARIANTS))
def test_logits_equal_transformers(models, name):
    path, model, expected = models[name]
    assert router_margin(model) > 1e-4
    m = hf_config(path).model
    assert {k: (tuple(m[k]) if k == "layer_types" else m[k]) for k in EXPECTED[name]} == EXPECTED[name]
    assert m.moe_balance_coef == model.config.router_aux_loss_coef and m.capacity_factor == 0
    close(our_logits(path), expected)


def fused(path, out, prefix_from: str, names: tuple) -> None:
    """The checkpoint in `path` rewritten to `out` with its experts fused as transformers holds
    them in memory (gate_up_proj [E, 2f, d], down_proj [E, d, f]) under 'mlp.'."""
    tensors = load_file(path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    n_experts = config["num_local_experts"]
    moved = {}
    for i in range(config["num_hidden_layers"]):
        old, new = f"model.layers.{i}.{prefix_from}", f"model.layers.{i}.mlp."
        per = {n: [tensors.pop(f"{old}experts.{e}.{n}.weight") for e in range(n_experts)] for n in names}
        gate, up, down = names
        moved[new + "experts.gate_up_proj"] = np.stack([np.concatenate(p) for p in zip(per[gate], per[up])])
        moved[new + "experts.down_proj"] = np.stack(per[down])
        moved[new + "gate.weight"] = tensors.pop(old + "gate.weight")
    out.mkdir()
    save_file(tensors | moved, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))


def test_fused_experts_import_alike(models, tmp_path):
    path, _, expected = models["mixtral"]
    fused(path, tmp_path / "fused", "block_sparse_moe.", ("w1", "w3", "w2"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fused", dtype=torch.float32).eval()
    close(hf_logits(reloaded), expected)  # the layout is the one transformers computes with
    spec = ModelSpec.from_config(hf_config(path).model)
    want, got = lazy_params(path, spec, "per expert"), lazy_params(tmp_path / "fused", spec, "fused")
    for leaf in ("router", "w_gate", "w_up", "w_down"):
        a, b = want["blocks"]["moe"][leaf], got["blocks"]["moe"][leaf]
        assert a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
        np.testing.assert_array_equal(b[1:2, 1:3], a[1:2, 1:3])  # one layer, two experts: a partial read


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices")
def test_each_device_reads_only_its_experts(models, monkeypatch):
    from lm.store import safetensors_files

    path = models["mixtral"][0]
    read = []
    original = safetensors_files.TensorFiles.read

    def counting(self, name, rows=None):
        out = original(self, name, rows)
        read.append((name, out.nbytes))
        return out

    monkeypatch.setattr(safetensors_files.TensorFiles, "read", counting)
    # 2 experts a device, their width halved
    config = with_values(hf_config(path), {"mesh.data": 1, "mesh.fsdp": 1, "mesh.expert": 2, "mesh.tensor": 2})
    built = build_model(config, jax.devices()[:4], rules=rules_table(config))
    lazy = lazy_params(path, built.spec, str(path))
    placed = built.place(lazy)
    for e in range(4):  # w1 [f, d]: the two devices holding expert e read half its rows each; w2 [d, f] whole rows
        assert [n for name, n in read if name == f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight"] == [
            48 * 64 * 4
        ] * 2
        assert [n for name, n in read if name == f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight"] == [
            64 * 96 * 4
        ] * 2
    for leaf in ("router", "w_gate", "w_up", "w_down"):
        got = placed["blocks"]["moe"][leaf]
        if leaf != "router":
            assert got.addressable_shards[0].data.shape[1] == 2  # split by expert
        np.testing.assert_array_equal(np.asarray(got), np.asarray(lazy["blocks"]["moe"][leaf]))


@pytest.mark.parametrize("name", list(MOE_VARIANTS))
def test_imported_model_goes_back_with_its_logits(models, name, tmp_path):
    path, original, expected = models[name]
    done = export_hf(load_hf(path), tmp_path / "out")
    assert done["architecture"] == type(original).__name__
    # the tensors transformers itself writes
    assert sorted(load_file(tmp_path / "out" / "model.safetensors")) == sorted(load_file(path / "model.safetensors"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert type(reloaded) is type(original)
    for key in ("num_experts_per_tok", "norm_topk_prob", "sliding_window", "tie_word_embeddings"):
        assert getattr(reloaded.config, key, None) == getattr(original.config, key, None), key
    close(hf_logits(reloaded), expected)


def trained_here(**model):
    c = base_config()
    c.model.update(
        dict(
            vocab_size=288,
            d_model=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            d_ff=96,
            max_seq_len=64,
            tie_embeddings=False,
            init_std=0.1,
            n_experts=4,
            experts_per_token=2,
            expert_d_ff=48,
        )
        | model
    )
    return c


@pytest.mark.parametrize(
    "keys, architecture, experts_key, width_key",
    [
        (dict(), "MixtralForCausalLM", "num_local_experts", "intermediate_size"),
        (dict(qk_norm=True, router_norm=False), "Qwen3MoeForCausalLM", "num_experts", "moe_intermediate_size"),
    ],
)
def test_trained_here_exports_as_mixtral_or_qwen3_moe(tmp_path, keys, architecture, experts_key, width_key):
    config = trained_here(**keys)
    module = Transformer(ModelSpec.from_config(config.model))
    params = jax.tree.map(np.asarray, nn.unbox(jax.jit(lambda r: init_params(module, r))(jax.random.PRNGKey(0))))
    rng = np.random.default_rng(0)  # norm scales away from 1: a swapped q/k norm shows
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x + rng.normal(0, 0.2, x.shape).astype(x.dtype) if "scale" in str(p[-1]) else x, params
    )
    done = export_hf(Loaded(config, params, ByteTokenizer(), "moe model"), tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert done["architecture"] == architecture and hf["architectures"] == [architecture]
    assert (hf[experts_key], hf["num_experts_per_tok"], hf[width_key]) == (4, 2, 48)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(model).__name__ == architecture and router_margin(model) > 1e-4
    pos = jnp.broadcast_to(jnp.arange(IDS.shape[1]), IDS.shape)
    ours = np.asarray(jax.jit(module.apply)({"params": params}, jnp.asarray(IDS), jnp.ones_like(IDS), pos))
    close(hf_logits(model), ours)


@pytest.mark.parametrize(
    "keys, pattern",
    [
        (dict(router_norm=False), r"Mixtral checkpoint: model.router_norm=False \(Mixtral needs True\)"),
        (dict(shared_d_ff=32), r"Mixtral checkpoint: model.shared_d_ff=32 \(Mixtral needs 0\)"),
        (dict(router_score="sigmoid"), r"model.router_score='sigmoid' \(Mixtral needs 'softmax'\)"),
        (dict(qk_norm=True, shared_d_ff=32), r"Qwen3-MoE checkpoint: model.shared_d_ff=32 \(Qwen3-MoE needs 0\)"),
    ],
)
def test_trained_here_refusals_name_the_key(tmp_path, keys, pattern):
    with pytest.raises(UserError, match=pattern):  # refused before any param is read
        export_hf(Loaded(trained_here(**keys), {}, ByteTokenizer(), "moe model"), tmp_path)


def test_import_refusals_name_the_key(models, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for name, change, pattern in [
        ("qwen3_moe", {"mlp_only_layers": [1]}, r"'mlp_only_layers' = \[1\] is not supported"),
        ("qwen3_moe", {"decoder_sparse_step": 2}, r"'decoder_sparse_step' = 2 is not supported"),
        ("qwen3_moe", {"shared_expert_intermediate_size": 32}, r"'shared_expert_intermediate_size' = 32"),
        ("qwen3_moe", {"hidden_act": "gelu"}, r"'hidden_act' = 'gelu' is not supported"),
        ("qwen3_moe", {"num_experts_per_tok": None}, r"no positive 'num_experts_per_tok'"),
        ("mixtral", {"num_local_experts": 0}, r"no positive 'num_local_experts'"),
    ]:
        config = json.loads((models[name][0] / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps(config | change))
        with pytest.raises(UserError, match=pattern):
            hf_config(bad)
    path = models["mixtral"][0]
    config = json.loads((path / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config))
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, bad / "model.safetensors")
    spec = ModelSpec.from_config(hf_config(bad).model)
    with pytest.raises(UserError, match=r"tensor 'model.layers.1.block_sparse_moe.experts.3.w2.weight' is missing"):
        lazy_params(bad, spec, "m")
