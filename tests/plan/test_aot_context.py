"""The real TPU compiler (libtpu) on a v5p-8 topology (4 chips) from this CPU-only machine: a tiny
pretraining step with the sequence split two ways over `context` and the rows two ways over `data`
(no param split, so the attention's exchange is the only one beside the gradients' reduction)
compiles to the collectives of its strategy: all-gathers of keys and values, or a ring of
collective-permutes."""

import importlib.util

import pytest

from lm.config import load_config
from lm.plan.aot import compile_step, target_devices
from lm.plan.hardware import parse_target

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs lm[tpu] (libtpu)"),
]

OVERRIDES = ["mesh.data=2", "mesh.fsdp=1", "mesh.context=2", "mesh.tensor=1", "train.batch_size=2"]


def hlo(strategy: str) -> str:
    config = load_config("configs/tiny.py", [*OVERRIDES, f"model.context_attention={strategy}"])
    compiled = compile_step("pretrain", config, target_devices(parse_target("v5p-8")))
    assert compiled.error is None, compiled.error
    return compiled.compiled.as_text()


def test_allgather_gathers_keys_and_values():
    text = hlo("allgather")
    assert "all-gather" in text and "collective-permute" not in text


def test_ring_passes_blocks_with_collective_permutes():
    text = hlo("ring")
    assert "collective-permute" in text and "all-gather" not in text
