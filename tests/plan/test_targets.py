"""Compile targets (Cloud TPU slice names, simulated CPU devices), the planner's exact state
bytes, `lm plan --fit`'s candidates and the one-line refusals."""

import importlib.util

import pytest

from lm.config import load_config, with_values
from lm.errors import UserError
from lm.model import counts
from lm.plan.fit import candidates
from lm.plan.hardware import GPUS, TPUS, chip_of_kind, parse_target
from lm.plan.memory import estimate


@pytest.mark.parametrize(
    "name, chips, topology",
    [
        ("v5p-8", 4, "v5p:2x2x1"),
        ("v5p-64", 32, "v5p:2x4x4"),
        ("v5p-512", 256, "v5p:4x8x8"),
        ("v4-8", 4, "v4:2x2x1"),
        ("v5e-4", 4, "v5e:2x2"),
        ("v5e-16", 16, "v5e:4x4"),
        ("v6e-256", 256, "v6e:16x16"),
    ],
)
def test_slice_names_map_to_chips_and_topologies(name, chips, topology):
    t = parse_target(name)
    assert (t.platform, t.chips, t.topology) == ("tpu", chips, topology)
    assert t.hbm_bytes == TPUS[name.split("-")[0]].hbm_bytes


def test_cpu_target_and_refusals():
    assert (parse_target("cpu:8").platform, parse_target("cpu:8").chips) == ("cpu", 8)
    for bad, says in [
        ("v5p-6", "no v5p slice of that size"),
        ("v9-8", "expected cpu:N or a TPU slice"),
        ("cpu:0", "expected cpu:N"),
        ("v5e-12", "sizes: v5e-1, v5e-4"),
    ]:
        with pytest.raises(UserError, match=says):
            parse_target(bad)


def test_device_kinds_name_their_chips():
    assert chip_of_kind("TPU v5 lite") is TPUS["v5e"]
    assert chip_of_kind("NVIDIA H100 80GB HBM3") is GPUS["H100"]
    assert chip_of_kind("NVIDIA H200") is GPUS["H200"]
    assert chip_of_kind("cpu") is None


def test_planner_state_is_exact_for_llama3_8b():
    # fsdp=8 splits every weight 8 ways except the norms (replicated): 266,240 norm params stay whole
    config = load_config("configs/llama3_8b.py", ["mesh.fsdp=8", "train.micro_batches=1"])
    parts = estimate(config, "pretrain", 8).parts
    n, norms = counts.param_count(config.model), counts.param_breakdown(config.model)["norms"]
    assert parts["params"] == 4 * ((n - norms) // 8 + norms)
    assert parts["optimizer"] == 2 * parts["params"] and parts["grads"] == parts["params"]
    two = estimate(load_config("configs/llama3_8b.py", ["mesh.fsdp=8", "train.micro_batches=2"]), "pretrain", 8)
    assert two.parts["grads"] == 2 * parts["params"]  # the accumulator beside one micro-batch's
    # twice the fsdp shards: half of every state part (but the replicated norms)
    sixteen = estimate(load_config("configs/llama3_8b.py", ["mesh.fsdp=16", "train.micro_batches=1"]), "pretrain", 16)
    for k in ("params", "optimizer", "grads"):
        assert sixteen.parts[k] == pytest.approx(parts[k] / 2, rel=1e-3)


def test_lora_and_reference_steps_hold_their_frozen_models():
    config = load_config("configs/llama3_8b.py", ["mesh.fsdp=8"])
    full = estimate(config, "pretrain", 8).parts
    lora = estimate(config, "sft_lora", 8).parts
    assert lora["frozen base"] == pytest.approx(full["params"] / 2, rel=1e-3)  # bf16, not float32
    assert lora["params"] < full["params"] / 20  # rank-16 adapters only
    dpo = estimate(config, "dpo", 8).parts
    assert dpo["reference"] == pytest.approx(full["params"] / 2, rel=1e-3)


def test_fit_candidates_start_with_the_config_and_change_little():
    config = load_config("configs/llama3_70b.py")
    found = candidates(config, "pretrain", 32)
    first = found[0]
    assert (first.model.remat, first.train.micro_batches, first.mesh.fsdp, first.mesh.tensor) == ("full", 4, 4, 8)
    assert all(c.train.batch_size == 1024 for c in found)
    assert any(c.train.micro_batches == 256 for c in found)


def test_tpu_target_without_libtpu_says_what_to_install(monkeypatch):
    from lm.plan import aot

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=r"pip install 'lm\[tpu\]'"):
        aot.target_devices(parse_target("v5p-64"))


def test_plan_compiles_on_cpu_devices_and_prints_both_columns(capsys):
    from lm.cli import main

    args = [
        "plan",
        "--config",
        "configs/tiny.py",
        "--target",
        "cpu:8",
        "--compile",
        "--steps",
        "pretrain,decode",
        "--config.mesh.data=4",
        "--config.mesh.fsdp=2",
        "--config.train.batch_size=8",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "pretrain: mesh data=4 fsdp=2 tensor=1" in out and "decode: mesh" in out
    assert out.count("arguments") == 2 and out.count("temporaries") == 2  # the compiler's column, per step
    assert "model FLOPs per chip a step" in out and "(CPU devices: no memory limit to check)" in out


def test_plan_rejects_unknown_steps(capsys):
    from lm.cli import main

    assert main(["plan", "--config", "configs/tiny.py", "--target", "cpu:8", "--steps", "pretrain,warmup"]) == 2
    assert "--steps pretrain,warmup: unknown ['warmup']" in capsys.readouterr().err


def test_fit_finds_two_rows_per_chip_for_70b_on_a_v5p_64():
    """With fused attention (splash: no [heads, T, T] scores) two rows of 8192 fit a chip a micro-batch
    (one with `xla` attention)."""
    from lm.plan.fit import search

    config = load_config("configs/llama3_70b.py")  # 4 micro-batches: 64 rows of 8192 a chip
    found, est, compiled = search(config, "pretrain", parse_target("v5p-64"), devices=None)
    assert compiled is None and est.total < 0.92 * parse_target("v5p-64").hbm_bytes
    assert (found.train.micro_batches, found.model.remat, found.mesh.fsdp, found.mesh.tensor) == (128, "full", 4, 8)
    xla = search(with_values(config, {"model.attention": "xla"}), "pretrain", parse_target("v5p-64"), devices=None)[0]
    assert xla.train.micro_batches == 256


def test_step_flops_count_every_token_of_the_step():
    from lm.plan.report import step_flops

    config = load_config("configs/llama3_70b.py")
    per_token = counts.flops_per_token(config.model, 8192)
    assert step_flops(config, "pretrain", 32) == pytest.approx(per_token * 1024 * 8192 / 32)
    assert step_flops(config, "dpo", 32) == pytest.approx(per_token * 4 / 3 * 2 * 1024 * 8192 / 32)
