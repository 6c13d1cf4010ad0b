"""The planner's pipeline schedules: 1F1B's bubble and held activations by hand, the plan line,
and the compiler agreeing that 1F1B holds less than GPipe."""

import pytest

from lm.config import load_config
from lm.plan.hardware import parse_target
from lm.plan.memory import estimate, mesh_sizes
from lm.plan.pipeline_memory import pipeline_of


def seventy_b(*overrides):
    return load_config("configs/llama3_70b_pipeline.py", list(overrides))


def test_1f1b_holds_its_tables_peak_by_hand():
    """Llama-3-70B, 4 stages x 16 pipeline micro-batches of one 8192-token row, the stream split
    over tensor 8 (1024 wide), bf16: 1F1B keeps 4 stage inputs and 1 returned gradient, where
    GPipe saves every layer's input of all 19 iterations; the logits are one micro-batch's."""
    target = parse_target("v5p-128")
    gpipe = estimate(seventy_b(), "pretrain", target.chips, chip=target.chip).parts
    one = estimate(seventy_b("model.pipeline_schedule=1f1b"), "pretrain", target.chips, chip=target.chip).parts
    stream = 1 * 8192 * 1024 * 2
    assert one["in-flight inputs"] == (4 + 1) * stream
    assert "in-flight inputs" not in gpipe
    # full remat saves each layer's input: 20 layers for 1F1B's one recomputed chunk, 19 x 20 for GPipe
    rope = 16 * 2 * 8192 * 128 * 4  # every micro-batch's RoPE tables, float32
    assert one["saved residuals"] == 20 * stream + rope
    assert gpipe["saved residuals"] == 19 * 20 * stream + 19 * 2 * 8192 * 128 * 4
    assert one["logits"] * 16 == gpipe["logits"]
    assert sum(one.values()) < sum(gpipe.values())


@pytest.mark.parametrize("repeats,held", [(1, 4), (2, 10)])
def test_pipeline_of_names_the_schedule_and_its_bubble(repeats, held):
    config = seventy_b("model.pipeline_schedule=1f1b", f"model.pipeline_repeats={repeats}")
    pipe = pipeline_of(config, "pretrain", mesh_sizes(config, 64))
    assert pipe.name == ("1F1B" if repeats == 1 else "interleaved 1F1B, 2 virtual stages")
    assert pipe.bubble == pytest.approx(3 / (16 * repeats + 3))
    assert pipe.held == held


def test_plan_prints_the_schedule(capsys):
    from lm.cli import main

    args = ["plan", "--config", "configs/llama3_70b_pipeline.py", "--target", "v5p-128", "--steps", "pretrain"]
    assert main([*args, "--config.model.pipeline_schedule=1f1b", "--config.model.pipeline_repeats=2"]) == 0
    out = capsys.readouterr().out
    assert "4 stages (interleaved 1F1B, 2 virtual stages), 16 pipeline micro-batches" in out
    assert "bubble 8.6%" in out and "holds 10 chunk inputs a stage" in out


def test_the_compiler_agrees_1f1b_holds_less():
    """8 simulated CPU devices, 4 stages x data 2, 8 pipeline micro-batches: XLA's temporaries for
    the 1F1B step are below GPipe's, as the planner's are."""
    from lm.plan.aot import compile_step, target_devices

    base = [
        "model.remat=full",
        "train.batch_size=32",
        "data.seq_len=64",
        "model.max_seq_len=64",
        "mesh.data=2",
        "mesh.stage=4",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        "model.pipeline_microbatches=8",
    ]
    temps, planned = {}, {}
    for schedule in ("gpipe", "1f1b"):
        config = load_config("configs/tiny.py", [*base, f"model.pipeline_schedule={schedule}"])
        compiled = compile_step("pretrain", config, target_devices(parse_target("cpu:8")))
        assert compiled.error is None, compiled.error
        temps[schedule] = compiled.temporaries
        planned[schedule] = estimate(config, "pretrain", 8).by_kind()["temporaries"]
    assert temps["1f1b"] < temps["gpipe"], temps
    assert planned["1f1b"] < planned["gpipe"], planned
