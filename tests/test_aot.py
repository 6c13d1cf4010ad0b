"""Ahead-of-time compilation of a full-size config on 8 simulated devices (nothing allocated)."""

from lm import plan
from lm.aot import compile_train_step
from lm.config import load_config


def test_llama3_8b_compiles_fully_sharded():
    config = load_config("configs/llama3_8b.py", ["mesh.fsdp=8", "train.batch_size=8", "data.seq_len=512"])
    figures = compile_train_step(config)
    assert figures["devices"] == 8 and figures["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
    # Arguments are params + Adam's two moments, all float32 and split 8 ways.
    expected = 12 * plan.param_count(config.model) / 8
    assert abs(figures["argument_bytes_per_device"] - expected) / expected < 0.01
