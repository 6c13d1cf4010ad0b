"""The demo's mixture-of-experts stage: a short MoE run beside a dense run, at its active FLOPs."""

import json
import math


def test_moe_stage_trains_beside_the_dense_run(small_base, tmp_path):
    from lm.demo.evidence import evidence
    from lm.demo.moe import moe_pretraining

    out = moe_pretraining(tmp_path, small_base, steps=10, show_progress=False)
    config = json.loads((tmp_path / "pretrain-moe" / "config.json").read_text())
    dense = json.loads((small_base / "config.json").read_text())
    m = config["model"]
    assert (m["n_experts"], m["experts_per_token"], m["expert_d_ff"]) == (8, 2, dense["model"]["d_ff"] // 2)
    assert m["capacity_factor"] == 0.0  # dropless
    # the dense run's batches and learning-rate schedule: its seed, batch and decay length
    assert config["optim"]["decay_steps"] == dense["optim"]["decay_steps"] and config["train"]["steps"] == 10
    assert (config["train"]["seed"], config["train"]["batch_size"]) == (
        dense["train"]["seed"],
        dense["train"]["batch_size"],
    )
    assert math.isfinite(out["eval_loss"]) and out["eval_loss"] < out["eval_loss_init"]
    assert out["dense_eval_loss"] is not None  # the dense run evaluated at step 10 too
    assert out["routing"]["dropped"] == 0 and out["routing"]["balance"] >= 1.0 - 1e-4
    # equal active FLOPs: the active params are the dense model's plus the routers' d_model x experts
    assert out["active_params"] == out["dense_params"] + dense["model"]["n_layers"] * dense["model"]["d_model"] * 8
    assert out["params"] > out["dense_params"]
    assert (tmp_path / "pretrain-moe" / "moe_vs_dense.png").stat().st_size > 0
    text = evidence({"pretrain": {"eval_loss": 1.0, "unigram_baseline": 2.0}, "sft": {}, "moe": out}, 8)
    assert "mixture of experts (8 experts" in text and "0% of assignments dropped" in text
