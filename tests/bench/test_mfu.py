"""bench/mfu.py at its CPU shapes: one shape, one round, one timed step; the table and the JSON hold sane
figures, and the FLOPs per token (attention counted causally) match a hand count. No timing is asserted."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
HAS_TORCH = importlib.util.find_spec("torch") is not None


@pytest.mark.slow
def test_mfu_bench_small_shape(tmp_path):
    out = tmp_path / "mfu.json"
    cmd = [sys.executable, str(REPO / "bench" / "mfu.py"), "--shapes", "llama-8b-layers", "--rounds", "1"]
    cmd += ["--steps", "1", "--warmup", "1", "--peer-eager", "--json", str(out)]
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    header = next(line for line in lines if line.startswith("shape"))
    assert [c.strip() for c in header.split("|")][2:5] == ["lm tok/s", "lm MFU vendor", "lm MFU measured"]
    assert "target" not in header  # no targets on CPU
    assert any(line.startswith("llama-8b-layers |") for line in lines)

    figures = json.loads(out.read_text())
    assert figures["plan"]["platform"] == "cpu" and figures["plan"]["small"]
    assert figures["plan"]["vendor_peak"] is None and figures["measured_peak"] > 0
    (row,) = figures["shapes"]
    s = row["shape"]
    shape = [s[k] for k in ("layers", "d_model", "heads", "kv_heads", "d_ff", "vocab", "seq")]
    assert shape == [2, 128, 4, 1, 448, 1024, 256]
    assert (s["remat"], s["micro_batches"], s["tied"]) == ("none", 1, False)  # the fit search keeps the config's

    # by hand: 6 FLOPs per matmul weight per token (q, o: d x d; k, v: d x hd; gate, up, down; the head),
    # plus attention QK^T and AV over the causal half: 6 * L * heads * head_dim * T
    L, d, hd, T, V = 2, 128, 32, 256, 1024
    matmul = L * (2 * d * d + 2 * d * hd + 3 * d * 448) + d * V
    assert row["flops_per_token"] == 6 * matmul + 6 * L * 4 * hd * T
    assert row["flops_per_token_noncausal"] == 6 * matmul + 12 * L * 4 * hd * T
    assert row["params"] == 2 * V * d + L * (2 * d * d + 2 * d * hd + 3 * d * 448 + 2 * d) + d

    lm = row["lm"]
    assert lm["tokens_per_s"] > 0 and lm["mfu_measured"] > 0 and lm["mfu_vendor"] is None
    assert lm["rounds"][0]["loss"] > 0
    if HAS_TORCH:
        peer = row["peer"]
        assert peer["tokens_per_s"] > 0 and peer["mfu_measured"] > 0 and row["ratio"] > 0
        assert peer["rounds"][0]["params"] == row["params"]  # the same decoder, counted by torch
        assert peer["rounds"][0]["remat"] == "none"
