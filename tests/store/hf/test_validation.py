"""The Hugging Face reader validates before it computes: malformed safetensors headers, indexes and
config.json files, keys that would change the model, tensors of the wrong shape and non-finite
weights are each one UserError line naming the file, key or tensor. docs/hf.md's key table is
checked against the reader (and against transformers' config classes, where installed)."""

from __future__ import annotations

import copy
import json
import pathlib
import re
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lm.errors import UserError
from lm.store.hf.config import hf_config
from lm.store.safetensors_files import TensorFiles, check_finite

DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "hf.md"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "mixtral", "qwen3_moe")
MOE = ("mixtral", "qwen3_moe")
SETTINGS = settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def one_line(e: UserError) -> str:
    text = str(e)
    assert text and "\n" not in text, text
    return text


# ---- config.json: the key table in docs/hf.md ---------------------------------------------------------------------


def base(family: str) -> dict:
    """A small config.json of the family, with only the required keys (and the MoE sizes)."""
    out = dict(
        model_type=family,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    if family in MOE:
        out |= dict(num_experts_per_tok=2, moe_intermediate_size=24)
    return out


def rope(family: str, params: dict) -> dict:
    """A RoPE set as config.json holds it for the family (Gemma 3: the global layers' set)."""
    if family == "gemma3_text":
        return {"rope_parameters": {"full_attention": params, "sliding_attention": {"rope_type": "default"}}}
    return {"rope_parameters": params}


YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=1.0)
LLAMA3 = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
)
SLIDING = dict(use_sliding_window=True, sliding_window=8, max_window_layers=0)


def rope_probe(context: dict, key: str, value):
    return lambda f: (rope(f, context), rope(f, context | {key: value}))


# key -> family -> (context, change): config.json with `context` (over the family's base) against the same with
# `change` as well. A plain value v means ({}, {key: v}).
PROBES = {
    "num_key_value_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-3,
    "tie_word_embeddings": True,
    "rope_theta": 5e5,
    "intermediate_size": 96,
    "hidden_act": "gelu",
    "hidden_activation": "gelu",
    "attention_bias": True,
    "mlp_bias": True,
    "pretraining_tp": 2,
    "rope_parameters": lambda f: ({}, rope(f, {"rope_type": "linear", "factor": 2.0})),
    "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    "rope_parameters.rope_type": lambda f: ({}, rope(f, {"rope_type": "dynamic", "factor": 2.0})),
    "rope_parameters.rope_theta": rope_probe({"rope_type": "default"}, "rope_theta", 5e5),
    "rope_parameters.factor": rope_probe({"rope_type": "linear", "factor": 2.0}, "factor", 3.0),
    "rope_parameters.low_freq_factor": rope_probe(LLAMA3, "low_freq_factor", 2.0),
    "rope_parameters.high_freq_factor": rope_probe(LLAMA3, "high_freq_factor", 8.0),
    "rope_parameters.original_max_position_embeddings": rope_probe(LLAMA3, "original_max_position_embeddings", 32),
    "rope_parameters.beta_fast": rope_probe(YARN, "beta_fast", 16.0),
    "rope_parameters.beta_slow": rope_probe(YARN, "beta_slow", 2.0),
    "rope_parameters.attention_factor": rope_probe(YARN, "attention_factor", 1.5),
    "rope_parameters.mscale": rope_probe(YARN, "mscale", 2.0),
    "rope_parameters.mscale_all_dim": rope_probe(YARN, "mscale_all_dim", 2.0),
    "rope_parameters.truncate": rope_probe(YARN, "truncate", False),
    "partial_rotary_factor": 0.5,
    "rope_parameters.partial_rotary_factor": lambda f: (
        {},
        rope(f, {"rope_type": "default", "partial_rotary_factor": 0.5}),
    ),
    "rope_scaling.partial_rotary_factor": lambda f: (
        {},
        {"rope_scaling": {"rope_type": "default", "partial_rotary_factor": 0.5}},
    ),
    "rope_parameters.sliding_attention.rope_type": lambda f: (
        {},
        {
            "rope_parameters": {
                "full_attention": {"rope_type": "default"},
                "sliding_attention": {"rope_type": "linear", "factor": 2.0},
            }
        },
    ),
    "rope_local_base_freq": 5e4,
    "sliding_window": lambda f: (SLIDING if f.startswith("qwen") else {}, {"sliding_window": 6}),
    "use_sliding_window": lambda f: ({"sliding_window": 8, "max_window_layers": 0}, {"use_sliding_window": True}),
    "max_window_layers": lambda f: ({"use_sliding_window": True, "sliding_window": 8}, {"max_window_layers": 2}),
    "layer_types": lambda f: (
        SLIDING if f.startswith("qwen") else {},
        {"layer_types": ["full_attention"] * 3 + ["sliding_attention"]},
    ),
    "sliding_window_pattern": 2,
    "_sliding_window_pattern": 2,
    "query_pre_attn_scalar": 20,
    "attn_logit_softcapping": 10.0,
    "final_logit_softcapping": 10.0,
    "use_bidirectional_attention": True,
    "num_local_experts": 4,
    "num_experts": 4,
    "num_experts_per_tok": 1,
    "moe_intermediate_size": 16,
    "norm_topk_prob": True,
    "router_aux_loss_coef": 0.5,
    "decoder_sparse_step": 2,
    "mlp_only_layers": [0],
    "shared_expert_intermediate_size": 32,
    "router_jitter_noise": 0.5,
    "output_router_logits": True,
    "quantization_config": {"quant_method": "gptq", "bits": 4},
    "attention_dropout": 0.1,
    "initializer_range": 0.5,
    "use_cache": False,
    "pad_token_id": 7,
    "bos_token_id": 7,
    "eos_token_id": 7,
    "torch_dtype": "bfloat16",
    "dtype": "bfloat16",
    "architectures": ["SomethingForCausalLM"],
}


def doc_rows() -> list[tuple[str, str, str]]:
    """(key, family, status) for every row of docs/hf.md's key table and family it names."""
    rows = []
    for line in DOC.read_text().splitlines():
        m = re.match(r"\| `([^`]+)` \| ([^|]+) \| (\w+) \|", line)
        if m:
            key, families, status = m.groups()
            names = FAMILIES if families.strip() == "all" else [f.strip() for f in families.split(",")]
            assert set(names) <= set(FAMILIES), line
            rows += [(key, f, status) for f in names]
    return rows


ROWS = doc_rows()


def model_of(tmp: pathlib.Path, config: dict) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(config))
    return hf_config(tmp).model.to_dict()


def test_the_table_covers_every_transformers_config_field():
    transformers = pytest.importorskip("transformers")
    classes = dict(
        llama="LlamaConfig",
        mistral="MistralConfig",
        qwen2="Qwen2Config",
        qwen3="Qwen3Config",
        gemma2="Gemma2Config",
        gemma3_text="Gemma3TextConfig",
        mixtral="MixtralConfig",
        qwen3_moe="Qwen3MoeConfig",
    )
    documented = {(k, f) for k, f, _ in ROWS}
    assert len(documented) == len(ROWS), "a key is listed twice for one family"
    for family, name in classes.items():
        cls = getattr(transformers, name)
        fields = [k for c in cls.__mro__ if c is cls for k in vars(c).get("__annotations__", {})]
        assert fields, name
        missing = [k for k in fields if (k, family) not in documented]
        assert not missing, f"docs/hf.md has no row for {family}: {missing}"


@pytest.mark.parametrize("key, family, status", ROWS, ids=[f"{k}-{f}" for k, f, _ in ROWS])
def test_the_table_is_true(tmp_path, key, family, status):
    config = base(family)
    if status == "required":
        del config[key]
        with pytest.raises(UserError, match=re.escape(key)) as e:
            model_of(tmp_path, config)
        one_line(e.value)
        if key == "model_type":
            return
        config = base(family)
        probe = ({}, {key: config[key] * 2})
    else:
        probe = PROBES[key]
        probe = probe(family) if callable(probe) else ({}, {key: probe})
    context, change = probe
    if key in ("num_local_experts", "num_experts"):
        assert "num_local_experts" not in config and "num_experts" not in config
    before = copy.deepcopy(config | context)
    after = copy.deepcopy(config | context | change)
    if status == "refused":
        model_of(tmp_path / "ok", before)
        with pytest.raises(UserError, match=re.escape(key.split(".")[-1])) as e:
            model_of(tmp_path / "bad", after)
        one_line(e.value)
        return
    got, want = model_of(tmp_path / "after", after), model_of(tmp_path / "before", before)
    if status == "ignored":
        assert got == want
    else:
        assert status in ("supported", "required"), status
        assert got != want, f"{key} is not read for {family}"


def test_defaults_are_transformers_own(tmp_path):
    """A key left out means what transformers makes of it, not lm's own default."""
    cases = [
        ("mistral", "n_kv_heads", 8),
        ("mistral", "sliding_window", 4096),
        ("mixtral", "rope_theta", 1e6),
        ("mixtral", "norm_eps", 1e-5),
        ("qwen3", "head_dim", 128),
        ("qwen2", "n_kv_heads", 32),
        ("gemma2", "attn_softcap", 50.0),
        ("gemma2", "tie_embeddings", True),
        ("gemma3_text", "rope_theta", 1e6),
        ("gemma3_text", "rope_local_theta", 1e4),
        ("qwen3_moe", "n_experts", 128),
    ]
    for family, ours, want in cases:
        config = base(family)
        for key in ("num_key_value_heads", "head_dim", "tie_word_embeddings"):
            config.pop(key)
        config |= dict(hidden_size=64, num_attention_heads=32)  # any default number of kv heads divides 32
        assert model_of(tmp_path / family, config)[ours] == want, (family, ours)


def test_rope_scaling_wins_over_rope_parameters(tmp_path):
    config = base("llama") | {
        "rope_theta": 5e5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    }
    got = model_of(tmp_path, config)
    assert (got["rope_scaling"], got["rope_factor"], got["rope_theta"]) == ("linear", 2.0, 5e5)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"partial_rotary_factor": 0.5}, "'partial_rotary_factor' = 0.5"),
        (
            {"num_attention_heads": 3, "head_dim": None},
            "'num_attention_heads' = 3: expected a divisor of hidden_size=32",
        ),
        ({"num_hidden_layers": -2}, "'num_hidden_layers' = -2: expected a positive integer"),
        ({"num_hidden_layers": 0}, "'num_hidden_layers' = 0: expected a positive integer"),
        ({"num_key_value_heads": 3}, "'num_key_value_heads' = 3: expected a divisor of num_attention_heads=4"),
        ({"vocab_size": 0}, "'vocab_size' = 0"),
        ({"hidden_size": "32"}, "'hidden_size' = '32': expected a positive integer"),
        ({"hidden_size": 32.0}, "'hidden_size' = 32.0: expected a positive integer"),
        ({"rms_norm_eps": "small"}, "'rms_norm_eps' = 'small': expected a positive number"),
        ({"rms_norm_eps": float("nan")}, "'rms_norm_eps' = nan"),
        ({"model_type": 3}, "'model_type' = 3: expected a string"),
        ({"tie_word_embeddings": "yes"}, "'tie_word_embeddings' = 'yes': expected true or false"),
        ({"rope_scaling": [1, 2]}, "'rope_scaling' = [1, 2]: expected an object"),
        ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, "'factor' = '2': expected a positive number"),
        ({"layer_types": ["full_attention"]}, None),  # not read for Llama
    ],
)
def test_config_json_errors_are_one_line(tmp_path, change, words):
    config = base("llama") | change
    if words is None:
        model_of(tmp_path, config)
        return
    with pytest.raises(UserError) as e:
        model_of(tmp_path, config)
    assert words in one_line(e.value) and "config.json" in str(e.value)


def test_lm_config_refuses_bad_heads_and_layers():
    from lm.config import load_config

    for override, words in [
        ("model.n_heads=3", "model.n_heads"),
        ("model.n_layers=-1", "model.n_layers"),
        ("model.n_layers=0", "model.n_layers"),
        ("model.head_dim=-8", "model.head_dim"),
    ]:
        with pytest.raises(UserError, match=re.escape(words)) as e:
            load_config(None, [override])
        one_line(e.value)


# ---- tensors: shapes and values -----------------------------------------------------------------------------------


def tiny_llama(path: pathlib.Path, seed: int = 0, **change) -> dict:
    """A tiny Llama checkpoint written without transformers: config.json and model.safetensors."""
    from safetensors.numpy import save_file

    config = base("llama") | dict(num_hidden_layers=2) | change
    d, v, f, q, kv = 32, 64, 48, 4 * 8, 2 * 8
    rng = np.random.default_rng(seed)
    w = lambda *shape: rng.normal(0, 0.1, shape).astype(np.float32)
    tensors = {"model.embed_tokens.weight": w(v, d), "model.norm.weight": w(d) + 1, "lm_head.weight": w(v, d)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": w(d) + 1,
            p + "post_attention_layernorm.weight": w(d) + 1,
            p + "self_attn.q_proj.weight": w(q, d),
            p + "self_attn.k_proj.weight": w(kv, d),
            p + "self_attn.v_proj.weight": w(kv, d),
            p + "self_attn.o_proj.weight": w(d, q),
            p + "mlp.gate_proj.weight": w(f, d),
            p + "mlp.up_proj.weight": w(f, d),
            p + "mlp.down_proj.weight": w(d, f),
        }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


def place(path):
    import jax

    from lm.config import rules_table
    from lm.model.build import build_model
    from lm.store.hf.reader import lazy_params

    config = hf_config(path)
    built = build_model(config, jax.devices()[:1], rules=rules_table(config))
    return built.place(lazy_params(path, built.spec, str(path)))


def rewrite(path: pathlib.Path, tensors: dict) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(path / "model.safetensors"))


def test_a_tiny_checkpoint_loads(tmp_path):
    tensors = tiny_llama(tmp_path)
    params = place(tmp_path)
    np.testing.assert_allclose(np.asarray(params["embedding"]), tensors["model.embed_tokens.weight"])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weight_is_refused_naming_the_tensor(tmp_path, bad):
    tensors = tiny_llama(tmp_path)
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name][3, 5] = bad
    rewrite(tmp_path, tensors)
    with pytest.raises(UserError, match=re.escape(f"tensor '{name}' holds non-finite values")) as e:
        place(tmp_path)
    one_line(e.value)


def test_non_finite_bf16_weight_is_refused(tmp_path):
    import ml_dtypes

    tensors = tiny_llama(tmp_path)
    tensors = {k: x.astype(ml_dtypes.bfloat16) for k, x in tensors.items()}
    tensors["model.norm.weight"][2] = np.nan
    rewrite(tmp_path, tensors)
    with pytest.raises(UserError, match=r"tensor 'model.norm.weight' holds non-finite"):
        place(tmp_path)


def test_right_size_wrong_shape_is_refused_naming_the_tensor(tmp_path):
    tensors = tiny_llama(tmp_path)
    name = "model.layers.0.mlp.gate_proj.weight"
    tensors[name] = np.ascontiguousarray(tensors[name].T)  # [d, f] instead of [f, d]: the same 1,536 values
    rewrite(tmp_path, tensors)
    with pytest.raises(UserError, match=re.escape(f"tensor '{name}' has shape (32, 48); config.json implies (48, 32)")):
        place(tmp_path)


def test_integer_weight_is_refused(tmp_path):
    tensors = tiny_llama(tmp_path)
    tensors["model.norm.weight"] = np.ones(32, np.int32)
    rewrite(tmp_path, tensors)
    with pytest.raises(UserError, match=r"tensor 'model.norm.weight' has dtype I32; expected a floating dtype"):
        place(tmp_path)


def test_exports_with_non_finite_params_are_refused(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import save_file

    from lm.store.export import export_loaded
    from lm.store.hf.reader import load_hf
    from lm.store.load import load_trained
    from tests.hf_models import write_tokenizer

    tiny_llama(tmp_path / "hf")
    write_tokenizer(tmp_path / "hf", vocab=64)
    out = tmp_path / "export.safetensors"
    export_loaded(load_hf(tmp_path / "hf"), out)
    assert load_trained(params=str(out)).config.model.d_model == 32
    with safe_open(str(out), "np") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    tensors["blocks/attn/wq"][1, 2, 3] = np.inf
    save_file(tensors, str(out), metadata=metadata)
    with pytest.raises(UserError, match=r"param 'blocks/attn/wq' holds non-finite values") as e:
        load_trained(params=str(out))
    one_line(e.value)
    tree = {"embedding": np.ones((4, 2), np.float32), "blocks": {"attn": {"wq": np.ones((2, 2), np.float32)}}}
    check_finite(tree, "export 'x'")
    tree["blocks"]["attn"]["wq"][1, 1] = np.nan
    with pytest.raises(UserError, match=r"export 'x': param 'blocks/attn/wq' holds non-finite"):
        check_finite(tree, "export 'x'")


# ---- safetensors headers and indexes: malformed input, generated ----------------------------------------------------


def write_raw(path: pathlib.Path, header: bytes, data: bytes = b"\0" * 64, length: int | None = None) -> None:
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)


def read_dir(path: pathlib.Path) -> None:
    """The reader over a directory: one UserError line, or a readable set of tensors."""
    try:
        files = TensorFiles(path)
        for name in files.entries:
            files.read(name)
    except UserError as e:
        one_line(e)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
entries = (
    st.fixed_dictionaries(
        {},
        optional={
            "dtype": st.sampled_from(["F32", "BF16", "I8", "F8_E4M3", "f32", ""]) | json_values,
            "shape": st.lists(st.integers(-2, 6), max_size=3) | json_values,
            "data_offsets": st.lists(st.integers(-8, 80), min_size=0, max_size=3) | json_values,
        },
    )
    | json_values
)
headers = (
    st.dictionaries(
        st.sampled_from(["a", "b", "__metadata__", "model.norm.weight"]) | st.text(max_size=6), entries, max_size=4
    )
    | json_values
)


@SETTINGS
@given(header=headers, data=st.integers(0, 80))
def test_any_header_is_read_or_refused_in_one_line(tmp_path_factory, header, data):
    path = tmp_path_factory.mktemp("st")
    write_raw(path / "model.safetensors", json.dumps(header).encode(), b"\0" * data)
    read_dir(path)


@SETTINGS
@given(raw=st.binary(max_size=40), length=st.none() | st.integers(0, 2**64 - 1))
def test_any_bytes_are_refused_in_one_line(tmp_path_factory, raw, length):
    path = tmp_path_factory.mktemp("st")
    write_raw(path / "model.safetensors", raw, b"", length)
    read_dir(path)


@SETTINGS
@given(
    index=json_values
    | st.fixed_dictionaries(
        {
            "weight_map": json_values
            | st.dictionaries(
                st.text(max_size=4),
                st.sampled_from(["model.safetensors", "none.safetensors", "..", "/", "sub/x"]) | json_values,
                max_size=3,
            )
        }
    )
)
def test_any_index_is_read_or_refused_in_one_line(tmp_path_factory, index):
    path = tmp_path_factory.mktemp("st")
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    write_raw(path / "model.safetensors", json.dumps(header).encode(), np.ones(2, np.float32).tobytes())
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    read_dir(path)


config_values = (
    st.none()
    | st.booleans()
    | st.integers(-3, 70)
    | st.floats()
    | st.text(max_size=5)
    | st.lists(st.integers(-1, 3) | st.text(max_size=3), max_size=3)
    | st.dictionaries(
        st.sampled_from(["rope_type", "factor", "rope_theta", "type", "partial_rotary_factor", "full_attention"]),
        st.none() | st.floats() | st.text(max_size=6) | st.sampled_from(["linear", "yarn", "llama3", "dynamic"]),
        max_size=3,
    )
)
config_keys = st.sampled_from(sorted({k.split(".")[0] for k, _, _ in ROWS}))


@SETTINGS
@given(
    family=st.sampled_from(FAMILIES),
    changes=st.dictionaries(config_keys, config_values, max_size=4),
    dropped=st.lists(config_keys, max_size=2),
)
def test_any_config_json_is_read_or_refused_in_one_line(tmp_path_factory, family, changes, dropped):
    config = base(family) | changes
    for key in dropped:
        config.pop(key, None)
    path = tmp_path_factory.mktemp("cfg")
    (path / "config.json").write_text(json.dumps(config))
    try:
        hf_config(path)
    except UserError as e:
        one_line(e)


@pytest.mark.parametrize(
    "header, words",
    [
        ({"a": [1, 2]}, "tensor 'a': header entry is a list"),
        ([1, 2], "safetensors header is a JSON list"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "__metadata__": {"k": 1}}, "'__metadata__'"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, "tensor 'a' is cut short or malformed"),
        ({"a": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}, "tensor 'a': shape [2.0]"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, "tensor 'a': data_offsets [8, 0]"),
        ({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, "tensor 'a': dtype 'Q4'"),
    ],
)
def test_header_errors_name_what_and_where(tmp_path, header, words):
    write_raw(tmp_path / "model.safetensors", json.dumps(header).encode(), b"\0" * 8)
    with pytest.raises(UserError) as e:
        TensorFiles(tmp_path)
    assert words in one_line(e.value) and "model.safetensors" in str(e.value)


def test_absurd_header_length_is_refused_before_reading(tmp_path):
    write_raw(tmp_path / "model.safetensors", b"{}", b"", length=2**62)
    with pytest.raises(UserError, match=r"header length 4611686018427387904; expected 2 to 2 for a file of 10 bytes"):
        TensorFiles(tmp_path)


def test_index_errors_name_what_and_where(tmp_path):
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    write_raw(tmp_path / "model-1.safetensors", json.dumps(header).encode(), b"\0" * 8)
    index = tmp_path / "model.safetensors.index.json"
    for weight_map, words in [
        (["a"], "'weight_map' is list; expected an object"),
        ({"a": "gone.safetensors"}, "names 'gone.safetensors', which is not in"),
        ({"a": "../model-1.safetensors"}, "expected the name of a file in"),
        ({"b": "model-1.safetensors"}, "puts 'b' in 'model-1.safetensors', whose header"),
    ]:
        index.write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(UserError) as e:
            TensorFiles(tmp_path)
        assert words in one_line(e.value) and "model.safetensors.index.json" in str(e.value)
    index.write_text(json.dumps({"weight_map": {"a": "model-1.safetensors"}}))
    assert TensorFiles(tmp_path).shape("a") == (2,)
