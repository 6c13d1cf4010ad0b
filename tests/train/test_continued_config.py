"""`lm train --init`: the model section comes from the model it continues, and the command line's
own `model.*` overrides win over it (a long-context extension's RoPE scaling and length)."""

from lm.config import load_config
from lm.train.finetune import continued_config


def test_explicit_model_overrides_win_over_the_start_models_section():
    start = load_config("configs/tiny.py", ["model.max_seq_len=128", "data.seq_len=128", "model.d_model=96"])
    overrides = ["model.max_seq_len=512", "model.rope_scaling=linear", "model.rope_factor=4.0", "data.seq_len=512"]
    config = load_config("configs/tiny.py", overrides)
    c = continued_config(config, start, "/runs/base", "/runs/base", overrides)
    assert (c.model.max_seq_len, c.model.rope_scaling, c.model.rope_factor) == (512, "linear", 4.0)
    assert c.model.d_model == 96  # the rest of the architecture is the start model's
    assert c.data.seq_len == 512 and c.train.init == "/runs/base"


def test_without_overrides_the_start_model_and_its_length_rule():
    start = load_config("configs/tiny.py", ["model.max_seq_len=128", "data.seq_len=128"])
    config = load_config("configs/tiny.py", ["data.seq_len=256", "model.d_model=32"])
    c = continued_config(config, start, "/runs/base", "/runs/base")
    assert c.model.max_seq_len == 128 and c.data.seq_len == 128  # cut to the model's length
    assert c.model.d_model == start.model.d_model  # a config file's model section does not win
