"""bench/token_efficiency.py: where a curve first reaches the peer's final loss (interpolated by
hand), nanoGPT's log lines, and a quick end-to-end run with the peer skipped (no torch needed)."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("token_efficiency", REPO / "bench" / "token_efficiency.py")
te = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(te)

NANOGPT_LOG = """\
tokens per iteration will be: 16,384
found vocab_size = 256 (inside data/stdlib_bytes/meta.pkl)
step 0: train loss 5.5452, val loss 5.5461
iter 0: loss 5.5420, time 41411.53ms, mfu -100.00%
iter 10: loss 3.1000, time 9000.00ms, mfu 1.00%
iter 20: loss 2.9000, time 9500.00ms, mfu 1.00%
step 20: train loss 2.8000, val loss 2.9000
iter 20: loss 2.9000, time 30000.00ms, mfu 1.00%
iter 30: loss 2.7000, time 9100.00ms, mfu 1.00%
"""


def test_parse_nanogpt_evals_and_times():
    assert te.parse_nanogpt_evals(NANOGPT_LOG) == [(0, 5.5452, 5.5461), (20, 2.8, 2.9)]
    # iteration 0 (start-up) and eval iterations are left out of the step times
    assert te.parse_nanogpt_iter_ms(NANOGPT_LOG, skip={0, 20}) == [9000.0, 9100.0]
    assert te.parse_nanogpt_evals("nothing here\n") == []


def test_first_reach_interpolates_between_eval_points():
    curve = [(0, 8.0), (100, 4.0), (200, 2.0), (300, 1.0)]
    # 3.0 lies halfway between 4.0 (at 100) and 2.0 (at 200)
    assert te.first_reach(curve, 3.0) == pytest.approx(150.0)
    # 1.5 lies halfway between 2.0 (at 200) and 1.0 (at 300)
    assert te.first_reach(curve, 1.5) == pytest.approx(250.0)
    assert te.first_reach(curve, 2.0) == pytest.approx(200.0)  # an eval point exactly on the target
    assert te.first_reach(curve, 9.0) == 0.0  # already there at the first point
    assert te.first_reach(curve, 0.5) is None  # never reached


def test_first_reach_takes_the_first_crossing():
    # down through 2.0 between 100 and 200, back up, down again: the first crossing counts
    curve = [(0, 5.0), (100, 3.0), (200, 1.0), (300, 4.0), (400, 0.5)]
    assert te.first_reach(curve, 2.0) == pytest.approx(150.0)


def test_fraction_of_peer():
    peer = [(0, 8.0), (1000, 3.0), (2000, 2.5)]
    ours = [(0, 8.0), (1000, 2.75), (2000, 2.25)]
    f = te.fraction_of_peer(ours, peer)
    # the peer ends at 2.5; ours is still above it at 1000 (2.75) and below at 2000 (2.25):
    # 1000 + (2.75 - 2.5) / (2.75 - 2.25) * 1000 = 1500 tokens, 0.75 of the peer's 2000
    assert f["tokens"] == pytest.approx(1500.0)
    assert f["fraction"] == pytest.approx(0.75)
    assert f["target_bpb"] == 2.5 and f["peer_tokens"] == 2000
    slower = te.fraction_of_peer([(0, 8.0), (2000, 2.6)], peer)
    assert slower["tokens"] is None and slower["fraction"] is None


def test_shapes_and_eval_iters():
    assert te.swiglu_d_ff(384) == 1024  # the SwiGLU width with a 4x GELU MLP's params
    assert te.swiglu_d_ff(512) == 1344
    assert te.eval_iters_for(65536, te.SHAPES["S"]) == 4
    assert te.eval_iters_for(65537, te.SHAPES["S"]) == 5
    assert te.eval_iters_for(1, te.SHAPES["S"]) == 1


@pytest.mark.slow
def test_quick_run_without_peer(tmp_path):
    cmd = [sys.executable, str(REPO / "bench" / "token_efficiency.py"), "--quick", "--muon", "no"]
    cmd += ["--workdir", str(tmp_path)]
    env = os.environ | {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "nanoGPT skipped" in proc.stdout
    out = json.loads((tmp_path / "token_efficiency.json").read_text())
    run = out["shapes"]["quick"]["runs"]["lm"]
    tokens = [t for t, _ in run["curve"]]
    assert tokens == [0, 5 * 8 * 64, 10 * 8 * 64]  # evals at 0, 5 and 10 steps of 8 x 64 tokens
    assert all(0 < bpb < 9 for _, bpb in run["curve"])
    assert run["train_bytes"] == out["data"]["train_bytes"]  # lm trained on the bytes the peer gets
    assert out["shapes"]["quick"]["fractions"] == {}
    assert (tmp_path / "token_efficiency_quick.png").stat().st_size > 0
    # the peer's files are not written without a peer; the eval set is
    assert not (tmp_path / "nanoGPT").exists()
    assert len((tmp_path / "heldout_eval.jsonl").read_text().splitlines()) == out["data"]["eval_files"]
