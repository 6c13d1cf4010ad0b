"""The demo's post-training section: its evidence lines from the runs' summaries, and the bytes
of a base held in NF4 against float32 (the QLoRA row)."""

import pytest

from lm.demo.posttrain import base_bytes, post_training_lines


def test_the_lines_show_each_run_before_and_after_and_what_rft_kept():
    runs = {
        "kto": {"exact_match_init": 0.9, "exact_match": 0.8, "step": 125},
        "orpo": {"exact_match_init": 0.0, "exact_match": 0.95, "step": 250},
        "rft": {
            "exact_match_init": 0.9,
            "exact_match": 0.91,
            "step": 22,
            "rft": {"kept": 1783, "prompts": 2000, "kept_share": 0.8914, "samples": 8000, "reward": {"mean": 0.56}},
        },
        "sft-qlora": {"exact_match_init": 0.0, "exact_match": 0.9, "base_bytes": {"float32": 4198912, "nf4": 1479168}},
        "sft-lora": {"exact_match": 0.92},
    }
    text = "\n".join(post_training_lines(runs))
    assert "KTO from SFT" in text and "90.0% ->   80.0%  (125 steps)" in text
    assert "ORPO from the base" in text and "95.0%" in text
    assert "RFT kept a sample for 1783 of 2000 prompts (89.1%)" in text
    assert "LoRA over the float base: 92.0%" in text and "4.20 MB in float32, 1.48 MB in NF4" in text


@pytest.mark.slow
def test_an_nf4_base_takes_about_a_seventh_of_the_float_layers(small_base):
    b = base_bytes(str(small_base))
    assert b["nf4"] < b["float32"] / 2  # the layers' weights at ~4.1 bits; embeddings and norms as saved
