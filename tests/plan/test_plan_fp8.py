"""The planner with model.fp8: a block product's weight is rounded once from float32 to one byte
(lm.model.fp8), so its copy for the step counts 1 byte a param where a bfloat16 model's counts 2,
and a float32 model gains that byte; the rest of the model keeps its compute-dtype copy. By hand
from the tiny model's param shapes. (Llama-3-8B on a v5p-8, TPU compiler: 31.86 -> 28.58 GiB of
temporaries with fp8, the planner 36.82 -> 35.19: docs/fp8.md.)"""

import math

import pytest

from lm.config import load_config
from lm.model.quant import BASE_WEIGHTS
from lm.model.spec import ModelSpec
from lm.plan.memory import estimate, param_leaves


def parts(*overrides):
    config = load_config("configs/tiny.py", ["optim.optimizer=adamw", *overrides])
    return config, estimate(config, "pretrain", 1).parts


def block_products(config) -> int:
    """float32 bytes of the blocks' fp8-product weights, by their names."""
    leaves = param_leaves(ModelSpec.from_config(config.model).replace(attention=dict(kernel="xla"), kernels="plain"))
    return sum(4 * math.prod(x.shape) for x in leaves if x.path.startswith("['blocks']") and x.name in BASE_WEIGHTS)


@pytest.mark.parametrize("dtype, itemsize", [("bfloat16", 2), ("float32", 4)])
def test_fp8_weights_count_one_byte_a_param(dtype, itemsize):
    config, plain = parts(f"model.compute_dtype={dtype}")
    _, f8 = parts(f"model.compute_dtype={dtype}", "model.fp8=true")
    products = block_products(config)
    assert 0 < products < plain["params"]
    if itemsize == 2:
        assert plain["params in compute dtype"] == plain["params"] // 2
        assert f8["params in compute dtype"] == (plain["params"] - products) // 2 + products // 4
    else:  # no copy without fp8; the fp8 weights' bytes with it
        assert "params in compute dtype" not in plain
        assert f8["params in compute dtype"] == products // 4
    assert {k: v for k, v in f8.items() if k != "params in compute dtype"} == {
        k: v for k, v in plain.items() if k != "params in compute dtype"
    }
