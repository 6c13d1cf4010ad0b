"""configs/llama3_8b_long.py, the long-context recipe (docs/long-context.md): it loads and validates,
its RoPE is extended to the sequence it trains on, and `lm plan` (the planner, no compile) says its
pretraining step fits its target with --fit's margin."""

from lm.config import load_config
from lm.plan.fit import MARGIN
from lm.plan.hardware import parse_target
from lm.plan.memory import estimate
from lm.plan.report import plan_target

RECIPE = "configs/llama3_8b_long.py"
TARGET = "v5p-64"  # the slice its docstring names: 32 chips, context 4 x tensor 8


def test_the_recipe_loads_with_its_long_context_settings():
    c = load_config(RECIPE)
    assert c.data.seq_len == c.model.max_seq_len == 131072
    assert (c.model.rope_scaling, c.model.rope_factor, c.model.rope_original_max_len) == ("llama3", 8.0, 8192)
    assert c.mesh.context > 1 and c.data.seq_len % (2 * c.mesh.context) == 0  # either strategy splits it
    assert c.optim.lr <= 3e-5 and c.optim.warmup_steps <= 100
    assert c.checkpoint.every_steps <= 100
    assert c.train.batch_size % c.train.micro_batches == 0
    assert c.model.context_attention == "ring"


def test_lm_plan_says_the_recipe_fits_its_target(capsys):
    c, target = load_config(RECIPE), parse_target(TARGET)
    mesh = c.mesh
    assert mesh.data * mesh.stage * mesh.fsdp * mesh.expert * mesh.context * mesh.tensor == target.chips
    assert estimate(c, "pretrain", target.chips, chip=target.chip).total <= MARGIN * target.hbm_bytes
    assert plan_target(c, target, ("pretrain",), compile_=False, fit=False) == 0
    out = capsys.readouterr().out
    assert "context=4 tensor=8" in out and "planner: fits" in out
