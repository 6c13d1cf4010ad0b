"""Ahead-of-time compilation on 8 simulated CPU devices (nothing allocated): every stage's step of a
small config, each with the planner's state bytes against the compiler's arguments. (The
planner's state for Llama-3-8B is checked by hand in tests/plan/test_targets.py.)"""

import pytest

from lm.config import load_config
from lm.plan.aot import compile_step, target_devices
from lm.plan.aot_steps import STEPS
from lm.plan.hardware import parse_target
from lm.plan.memory import estimate

SMALL = [
    "mesh.data=2",
    "mesh.fsdp=2",
    "mesh.tensor=2",
    "train.batch_size=8",
    "data.seq_len=64",
    "model.max_seq_len=64",
    "eval.batch_size=8",
    "rl.prompts_per_step=4",
    "rl.group_size=2",
]


@pytest.mark.parametrize("step", STEPS)
def test_every_step_compiles_and_its_arguments_are_the_planners(step):
    config = load_config("configs/tiny.py", SMALL)
    c = compile_step(step, config, target_devices(parse_target("cpu:8")))
    assert c.error is None and c.arguments > 0
    parts = estimate(config, step, 8).parts
    args = sum(parts.get(k, 0) for k in ("params", "optimizer", "frozen base", "reference", "kv cache"))
    # the planner's state and frozen models against the compiler's arguments (plus the batch, the step, the rng)
    assert abs(c.arguments - args) / args < 0.05, (step, c.arguments, parts)
