"""The planner with the sequence split over `context`: the per-device activations shrink by the
context size, the params do not, and the split attention's scores (and allgather's gathered keys
and values) are counted."""

import pytest

from lm.config import load_config
from lm.errors import UserError
from lm.plan.memory import CONTEXT_SCORES, RING_BLOCK_BYTES, estimate


def tiny_config(*overrides):
    return load_config("configs/tiny.py", ["model.remat=full", "optim.optimizer=adamw", "mesh.data=2", *overrides])


@pytest.mark.parametrize("strategy", ["allgather", "ring"])
def test_activations_divide_by_the_context_size(strategy):
    one = estimate(tiny_config(f"model.context_attention={strategy}"), "pretrain", 2).parts
    four = estimate(tiny_config("mesh.context=4", f"model.context_attention={strategy}"), "pretrain", 8).parts
    assert four["params"] == one["params"] and four["optimizer"] == one["optimizer"]  # params are not split
    for name in ("saved residuals", "layer backward", "logits"):
        assert four[name] == pytest.approx(one[name] / 4, rel=1e-6), name
    c = tiny_config().model
    rows, t, heads = 16 // 2, 256, c.n_heads
    assert "attention scores" not in one
    if strategy == "allgather":  # a quarter of the queries against every key: float32 buffers and probabilities
        assert four["attention scores"] == rows * heads * (t // 4) * t * (CONTEXT_SCORES[strategy] + 4)
    else:  # query blocks of up to 512 (here all 64 of a device's) against a device's 64 keys per step
        assert four["attention scores"] == int(RING_BLOCK_BYTES * rows * heads * (t // 4) * (t // 4))
    gathered = 2 * rows * t * c.n_kv_heads * (c.d_model // c.n_heads) * 4  # one layer's k and v (remat=full)
    assert four.get("gathered keys and values", 0) == (gathered if strategy == "allgather" else 0)
    assert sum(four.values()) < sum(one.values())


def test_a_sequence_that_does_not_split_is_refused():
    with pytest.raises(UserError, match="mesh.context"):
        tiny_config("mesh.context=3")
