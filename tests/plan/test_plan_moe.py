"""The planner for mixture-of-experts and pipelined configs: total and active params by hand (a tiny
MoE and Mixtral-8x7B), FLOPs per token over the active params, the expert axis and the pipeline's
stages in the per-device estimate, the bubble in the plan table."""

from types import SimpleNamespace

import flax.linen as nn
import jax
import numpy as np
import pytest

from lm.config import load_config
from lm.errors import UserError
from lm.model import counts
from lm.model.spec import ModelSpec
from lm.model.transformer import Transformer, init_params
from lm.plan import units
from lm.plan.memory import estimate


def tiny_moe(**overrides):
    # d=4, 1 layer, 2 query heads sharing 1 kv head of width 2, vocab 10; 4 experts of width 6, top-2
    fields = dict(
        vocab_size=10,
        d_model=4,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        head_dim=0,
        d_ff=8,
        mlp="swiglu",
        norm="rmsnorm",
        use_bias=False,
        position="rope",
        max_seq_len=16,
        tie_embeddings=True,
        post_norms=False,
        qk_norm=False,
        n_experts=4,
        experts_per_token=2,
        expert_d_ff=6,
        shared_d_ff=0,
        compute_dtype="float32",
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


def test_tiny_moe_total_and_active_params_by_hand():
    m = tiny_moe()
    attn, router, experts, norms, emb = 48, 4 * 4, 4 * 3 * 4 * 6, 3 * 4, 10 * 4  # experts: 4 x (gate, up, down)
    b = counts.param_breakdown(m)
    assert (b["attention"], b["router"], b["experts"], b["norms"]) == (attn, router, experts, norms)
    assert "mlp" not in b and "shared mlp" not in b
    assert counts.param_count(m) == emb + attn + router + experts + norms == 404
    assert counts.active_param_count(m) == 404 - experts + experts * 2 // 4 == 260  # 2 of the 4 experts
    assert counts.expert_params(m) == experts
    shared = tiny_moe(shared_d_ff=5)  # a shared SwiGLU of width 5 counts whole in both
    assert counts.param_breakdown(shared)["shared mlp"] == 3 * 4 * 5
    assert counts.param_count(shared) == 404 + 60 and counts.active_param_count(shared) == 260 + 60


def test_dense_models_are_all_active():
    m = load_config("configs/llama3_8b.py").model
    assert counts.active_param_count(m) == counts.param_count(m) == 8_030_261_248
    assert counts.expert_params(m) == 0


def test_flops_per_token_count_active_params():
    # matmul weights a token meets: attention 48, router 16, 2 of 4 experts 144, (tied) head 40
    assert counts.flops_per_token(tiny_moe(), 3) == 6 * (48 + 16 + 144 + 40) + 12 * 1 * 2 * 2 * 3 == 1632
    assert counts.flops_per_token(tiny_moe(shared_d_ff=5), 3) == 1632 + 6 * 60
    # all experts taken: the FLOPs of a dense model with the experts' weights
    every = tiny_moe(experts_per_token=4)
    assert counts.flops_per_token(every, 3) == 6 * (48 + 16 + 288 + 40) + 144


def test_mixtral_8x7b_is_46_7b_total_12_9b_active():
    m = load_config("configs/mixtral_8x7b.py").model
    d, L, ff, e, V = 4096, 32, 14336, 8, 32000
    attn = 2 * d * d + 2 * d * 1024  # q, o: 32 heads of 128; k, v: 8 heads of 128
    expert = 3 * d * ff
    total = 2 * V * d + L * (attn + d * e + e * expert + 2 * d) + d
    assert counts.param_count(m) == total == 46_702_792_704  # Hugging Face's Mixtral-8x7B count
    active = total - L * 6 * expert
    assert counts.active_param_count(m) == active == 12_879_925_248
    matmul = L * (attn + d * e + 2 * expert) + d * V  # blocks (router, 2 experts) + the head
    assert counts.flops_per_token(m, 4096) == 6 * matmul + 12 * L * 32 * 128 * 4096
    text = units.summary(m, 4096)
    assert "46,702,792,704 (46.70B) total, 12,879,925,248 (12.88B) active (2 of 8 experts)" in text
    assert "expert weights" in text and "180.39GB float32" in text


def test_built_moe_params_are_the_planners():
    config = load_config(
        "configs/tiny.py",
        ["model.n_experts=4", "model.experts_per_token=2", "model.expert_d_ff=96", "model.shared_d_ff=64"],
    )
    spec = ModelSpec.from_config(config.model).replace(attention=dict(kernel="xla"))
    boxed = jax.eval_shape(lambda key: init_params(Transformer(spec), key), jax.random.key(0))
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nn.unbox(boxed))) == counts.param_count(config.model)


def tiny_config(*overrides):  # AdamW: two moments per param (Muon's one per matrix: tests/train/test_muon.py)
    return load_config("configs/tiny.py", ["model.remat=full", "optim.optimizer=adamw", *overrides])


def test_expert_weights_split_over_the_expert_axis():
    moe = ["model.n_experts=4", "model.expert_d_ff=96", "train.batch_size=8"]
    one = estimate(tiny_config(*moe, "mesh.data=8"), "pretrain", 8).parts
    four = estimate(tiny_config(*moe, "mesh.data=2", "mesh.expert=4"), "pretrain", 8).parts
    experts = counts.expert_params(tiny_config(*moe).model)
    assert one["params"] - four["params"] == 4 * experts * 3 // 4  # float32, a quarter of them per device
    assert four["optimizer"] == 2 * four["params"]
    assert "expert work" in four and "mlp" not in str(four)


def test_pipeline_stage_holds_its_share_of_the_layers():
    pipe = ["model.pipeline_microbatches=4", "train.batch_size=16", "mesh.fsdp=1", "mesh.tensor=1"]
    m = tiny_config().model
    rest = m.vocab_size * m.d_model + m.d_model  # the (tied) embedding and the final norm: on every stage
    blocks = counts.param_count(m) - rest
    for stages in (1, 2, 4):
        parts = estimate(tiny_config(*pipe, f"mesh.stage={stages}", "mesh.data=-1"), "pretrain", 8).parts
        assert parts["params"] == 4 * (blocks // stages + rest)
        assert ("stage params" in parts) == (stages > 1)


def test_pipeline_refusals_name_the_keys():
    with pytest.raises(UserError, match="model.pipeline_microbatches=4 micro-batches"):
        estimate(
            tiny_config("mesh.stage=2", "mesh.data=4", "model.pipeline_microbatches=4", "train.batch_size=8"),
            "pretrain",
            8,
        )
    with pytest.raises(UserError, match="mixture-of-experts layers cannot be pipelined"):
        estimate(tiny_config("mesh.stage=2", "mesh.data=4", "model.n_experts=4", "train.batch_size=16"), "pretrain", 8)


def test_plan_prints_the_bubble_and_active_params(capsys):
    from lm.cli import main

    args = [
        "plan",
        "--config",
        "configs/tiny.py",
        "--target",
        "cpu:8",
        "--config.mesh.data=1",
        "--config.mesh.stage=4",
        "--config.mesh.fsdp=2",
        "--config.train.batch_size=16",
        "--config.model.pipeline_microbatches=8",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "pretrain: mesh data=1 stage=4 fsdp=2 tensor=1" in out
    assert "4 stages (GPipe), 8 pipeline micro-batches per micro-batch, 11 iterations: bubble 27.3%" in out
    assert main(["plan", "--config", "configs/mixtral_8x7b.py"]) == 0
    assert "(46.70B) total, 12,879,925,248 (12.88B) active" in capsys.readouterr().out


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.n_experts=4", "model.expert_d_ff=96", "mesh.data=2", "mesh.fsdp=2", "mesh.expert=2"],
        ["mesh.data=1", "mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2", "model.pipeline_microbatches=4"],
    ],
    ids=["experts", "stages"],
)
def test_compiled_arguments_are_the_planners_state(overrides):
    from lm.plan.aot import compile_step, target_devices
    from lm.plan.hardware import parse_target

    config = tiny_config("train.batch_size=16", "data.seq_len=64", "model.max_seq_len=64", *overrides)
    c = compile_step("pretrain", config, target_devices(parse_target("cpu:8")))
    assert c.error is None, c.error
    parts = estimate(config, "pretrain", 8).parts
    state = parts["params"] + parts["optimizer"]
    # the expert weights split over expert (x fsdp), the layers over the stages, as the compiler has them
    assert abs(c.arguments - state) / state < 0.05, (c.arguments, parts)


def test_pipelined_70b_config_splits_its_layers_over_four_stages():
    from lm.plan.hardware import parse_target
    from lm.plan.memory import mesh_sizes
    from lm.plan.pipeline_memory import pipeline_of

    target = parse_target("v5p-128")
    config = load_config("configs/llama3_70b_pipeline.py")
    mesh = mesh_sizes(config, target.chips)
    assert (mesh["stage"], mesh["fsdp"], mesh["tensor"]) == (4, 2, 8)
    assert pipeline_of(config, "pretrain", mesh).bubble == pytest.approx(3 / 19)
    parts = estimate(config, "pretrain", target.chips, chip=target.chip).parts
    m = config.model
    tables = 2 * m.vocab_size * m.d_model  # embedding and head: split over fsdp x tensor, on every stage
    blocks = counts.param_count(m) - tables - m.d_model  # less the final norm (replicated)
    norms = 2 * m.n_layers * m.d_model  # the blocks' norms: split over the stages only
    expected = (blocks - norms) // (4 * 2 * 8) + norms // 4 + tables // (2 * 8) + m.d_model
    assert parts["params"] == 4 * expected
    assert sum(parts.values()) < target.hbm_bytes
