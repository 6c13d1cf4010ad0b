"""The TPU compiler (libtpu, from this CPU-only machine) on the engine's decode block with int8
weights: every quantized weight enters a dot (convolution) fusion as int8, so the step reads one
byte per weight from HBM, and no fusion writes a float copy of a weight."""

import importlib.util
import re

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs lm[tpu] (libtpu)"),
]

L, D, F, V = 2, 512, 1024, 4096
OVERRIDES = [
    f"model.vocab_size={V}",
    f"model.d_model={D}",
    f"model.n_layers={L}",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.head_dim=128",
    f"model.d_ff={F}",
    "model.max_seq_len=256",
    "model.compute_dtype=bfloat16",
    "model.attention=xla",
    "model.kernels=plain",
    "mesh.data=4",
]


def compiled_decode(tied: bool) -> str:
    """The HLO of the decode block over 32 slots on a v5e-4 (rows split 4 ways: 8 a chip), with
    the convert-in-dot products (model.kernels=plain: what `auto` picks on a TPU host)."""
    from lm.config import load_config, rules_table
    from lm.infer.engine.engine import Engine, EngineConfig
    from lm.infer.generate import generation_context
    from lm.model.build import build_model
    from lm.model.quant import abstract_quantized
    from lm.plan.aot import target_devices
    from lm.plan.hardware import parse_target

    config = load_config("configs/tiny.py", [*OVERRIDES, f"model.tie_embeddings={tied}"])
    built = build_model(config, target_devices(parse_target("v5e-4")), rules=rules_table(config))
    engine = Engine(
        built.module,
        max_len=generation_context(built.spec),
        config=EngineConfig(slots=32),
        mesh=built.mesh,
        rules=built.rules,
        unstack=False,
    )
    fn, args = engine.abstract_decode(abstract_quantized(built, "int8"))
    return fn.lower(*args).compile().as_text()


@pytest.mark.parametrize("tied", [True, False])
def test_int8_weights_enter_their_dot_fusions_as_int8(tied):
    hlo = compiled_decode(tied)
    # the stacked layers' wq, wk/wv, wo, w_gate/w_up, w_down; the head (the table itself when tied)
    weights = [(L, D, 4, 128), (L, D, 2, 128), (L, 4, 128, D), (L, D, F), (L, F, D), (V, D) if tied else (D, V)]
    fusions = [c for c in re.split(r"\n(?=\S)", hlo) if re.search(r" (convolution|dot)\(", c)]
    int8_operands = {s for c in fusions for s in re.findall(r"s8\[([\d,]*)\]", c.split("{")[0])}
    assert {",".join(map(str, w)) for w in weights} <= int8_operands, int8_operands
    # and no fusion writes a float copy of a weight (one layer's or all of them)
    float_outputs = set(re.findall(r"= (?:bf16|f32)\[([\d,]+)\]\S* fusion\(", hlo))
    copies = {",".join(map(str, shape)) for w in weights for shape in (w, w[1:])} & float_outputs
    assert not copies, copies
