"""The real TPU compiler (libtpu, the `tpu` extra) on an 8-chip v5e topology, from this CPU-only
machine: the compiled shardings of every param and of the logits are the rule table's (a change
that silently replicates a weight fails here), and the planner agrees with the compiled memory."""

import importlib.util

import jax
import pytest
from jax.sharding import PartitionSpec as P

from lm.config import load_config, rules_table, with_values
from lm.model.apply import logits_of
from lm.model.build import build_model
from lm.plan.aot import compile_step, target_devices
from lm.plan.hardware import parse_target
from lm.plan.memory import estimate

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs lm[tpu] (libtpu)"),
]

TARGET = parse_target("v5e-8")
# big enough that the activations live in HBM, not in the chip's on-chip memory; one row per chip,
# as in the large configs the planner is fitted to
SEQ = 4096
OVERRIDES = [
    "model.vocab_size=4096",
    "model.d_model=256",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.d_ff=768",
    f"model.max_seq_len={SEQ}",
    "model.tie_embeddings=False",
    "model.compute_dtype=bfloat16",
    "model.attention=xla",
    "model.remat=full",
    f"data.seq_len={SEQ}",
    "train.batch_size=4",
    "mesh.data=1",
    "mesh.fsdp=4",
    "mesh.tensor=2",
]

# Where every param lives on the (data=1, fsdp=4, tensor=2) mesh: the default rule table, by hand (the
# stacked layers' axis follows the `stage` rule: size 1 here, but the compiled spec names it).
GOLDEN = {
    "['blocks']['attn']['k_norm']['scale']": P("stage", None),  # QK-norm: configs/tiny.py's recipe
    "['blocks']['attn']['q_norm']['scale']": P("stage", None),
    "['blocks']['attn']['wk']": P("stage", "fsdp", "tensor", None),
    "['blocks']['attn']['wo']": P("stage", "tensor", None, "fsdp"),
    "['blocks']['attn']['wq']": P("stage", "fsdp", "tensor", None),
    "['blocks']['attn']['wv']": P("stage", "fsdp", "tensor", None),
    "['blocks']['attn_norm']['scale']": P("stage", None),
    "['blocks']['mlp']['w_down']": P("stage", "tensor", "fsdp"),
    "['blocks']['mlp']['w_gate']": P("stage", "fsdp", "tensor"),
    "['blocks']['mlp']['w_up']": P("stage", "fsdp", "tensor"),
    "['blocks']['mlp_norm']['scale']": P("stage", None),
    "['embedding']": P("tensor", "fsdp"),
    "['final_norm']['scale']": P(None),
    "['head']": P("fsdp", "tensor"),
}


def stripped(spec: P) -> P:
    """A PartitionSpec without trailing Nones (the compiler drops them)."""
    parts = list(spec)
    while parts and parts[-1] is None:
        parts.pop()
    return P(*parts)


def spec_of(sharding) -> P:
    return stripped(sharding.spec)


@pytest.fixture(scope="module")
def config():
    return load_config("configs/tiny.py", OVERRIDES)


@pytest.fixture(scope="module")
def compiled(config):
    return compile_step("pretrain", config, target_devices(TARGET))


def test_compiled_param_shardings_are_the_rule_tables(compiled):
    assert compiled.error is None, compiled.error
    state = compiled.compiled.input_shardings[0][0]
    got = {jax.tree_util.keystr(path): spec_of(sh) for path, sh in jax.tree_util.tree_leaves_with_path(state.params)}
    assert got == {k: stripped(v) for k, v in GOLDEN.items()}
    # Adam's moments are split exactly like the params they belong to
    mu = compiled.compiled.input_shardings[0][0].opt_state
    mu_specs = {spec_of(sh) for sh in jax.tree.leaves(mu)}
    assert set(got.values()) <= mu_specs | {P()}


def test_compiled_logits_are_split_over_batch_and_vocab(config):
    devices = target_devices(TARGET)
    built = build_model(config, devices, rules=rules_table(config))
    params = jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
        built.abstract_params(),
        built.param_shardings,
    )
    rows = (4, 64)  # the sharding is the point, not the size: a short sequence compiles fast
    sig = {k: rows for k in ("inputs", "segment_ids", "positions")}
    shardings = built.batch_shardings(sig)
    batch = {k: jax.ShapeDtypeStruct(rows, "int32", sharding=shardings[k]) for k in sig}
    compiled = jax.jit(lambda p, b: logits_of(built.module, p, b)).lower(params, batch).compile()
    # rows over (data, fsdp) and the vocabulary over tensor; data has size 1 here, so the compiler drops it
    assert spec_of(compiled.output_shardings) == P("fsdp", None, "tensor")


def test_planner_within_tolerance_of_the_compiler(config, compiled):
    est = estimate(config, "pretrain", TARGET.chips, chip=TARGET.chip)
    assert compiled.total is not None
    assert abs(est.total - compiled.total) / compiled.total < 0.15, (est.parts, compiled)


def test_the_default_attention_compiles_to_splash_with_fewer_temporaries(config, compiled):
    """model.attention=auto on a TPU target is splash attention (a Pallas TPU kernel): the step
    compiles, and at seq 4096 it keeps no [heads, T, T] scores (xla's path above does)."""
    fused = compile_step("pretrain", with_values(config, {"model.attention": "auto"}), target_devices(TARGET))
    assert fused.error is None, fused.error
    assert "tpu_custom_call" in fused.compiled.as_text()
    assert "tpu_custom_call" not in compiled.compiled.as_text()
    scores = 4096 * 4096 * 4 * (4 // 2)  # one layer's float32 scores on a chip: 2 of the 4 heads, one row
    assert fused.temporaries + scores <= compiled.temporaries, (fused.temporaries, compiled.temporaries)
