"""bench/accelerator_check.py on CPU: the attention comparison must catch a path that lets packed
documents see each other (cuDNN is absent here, so a leaky stand-in plays the kernel under test),
and the table's exit code must follow the rows."""

import functools
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

import lm.model.attention as attention_module

REPO = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("accelerator_check", REPO / "bench" / "accelerator_check.py")
ac = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ac)

SEG = ac.packed_segments(2, 16)
ATTEND = attention_module.attend  # before any monkeypatch


def ignores_segments(q, k, v, segment_ids, implementation="xla", *args, **kw):
    """Causal attention over the whole row: the bug class of a GPU kernel that drops packing."""
    return ATTEND(q, k, v, jnp.ones_like(segment_ids), implementation, *args, **kw)


def test_packed_segments_have_several_documents_and_padding():
    seg = ac.packed_segments(3, 64)
    assert [len(set(row[row > 0])) for row in seg] == [3, 4, 5]
    assert (seg[-1, -8:] == 0).all() and (seg[:-1] > 0).all()
    assert (np.diff(seg[:, :56], axis=1) >= 0).all()  # documents are contiguous
    pos = ac.document_positions(np.array([[1, 1, 2, 2, 2, 0]], np.int32))
    np.testing.assert_array_equal(pos, [[0, 1, 0, 1, 2, 0]])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_kernel_comparison_passes_a_correct_path_and_fails_a_leaky_one(dtype):
    correct = functools.partial(ATTEND, implementation="xla")
    good = ac.judged("good", lambda: ac.attention_errors(correct, SEG, dtype, head_dim=16), ac.TOLERANCE[dtype])
    assert good["result"] == "pass", good
    errors = ac.attention_errors(ignores_segments, SEG, dtype, head_dim=16)
    assert errors["leak"] > 0.1 and errors["out"] > 0.1 and errors["dk"] > 0.1
    assert ac.judged("bad", lambda: errors, ac.TOLERANCE[dtype])["result"] == "FAIL"


def test_model_comparison_catches_a_leak(monkeypatch):
    """(A correct path passes in the CPU smoke run: ALLOW_CPU=1 QUICK=1 bench/accelerator_check.sh.)"""
    leaky = lambda q, k, v, seg, impl, *a, **kw: (ignores_segments if impl == "xla" else ATTEND)(
        q, k, v, seg, impl, *a, **kw
    )
    monkeypatch.setattr(attention_module, "attend", leaky)  # the reference path stays correct
    bad = ac.model_errors("xla", "bfloat16", SEG)
    assert bad["logits"] > 0.1 and bad["grads"] > 0.1 and bad["leak"] > 0.1, bad


def test_judged_reports_exceptions_and_nan_as_failures():
    def raises():
        raise NotImplementedError("Q must be fp16/bf16/fp8_e4m3fn/fp8_e5m2, got float32\nmore")

    row = ac.judged("x", raises, 1e-2)
    assert row["result"] == "FAIL"
    assert row["figure"] == "NotImplementedError: Q must be fp16/bf16/fp8_e4m3fn/fp8_e5m2, got float32"
    assert ac.judged("x", lambda: {"out": float("nan"), "leak": 0.0}, 1e-2)["result"] == "FAIL"
    assert ac.judged("x", lambda: {"out": 1e-3, "leak": 0.0}, 1e-2)["result"] == "pass"
    assert ac.judged("x", lambda: {"out": 1e-3, "leak": 2e-3}, 1e-2)["result"] == "FAIL"


def test_unavailable_paths_say_why():
    cuda = types.SimpleNamespace(platform="gpu", client=types.SimpleNamespace(platform_version="cuda 12080"))
    tpu = types.SimpleNamespace(platform="tpu", client=types.SimpleNamespace(platform_version="PJRT C API"))
    assert ac.unavailable("cudnn", "bfloat16", cuda) == ""
    assert "bf16" in ac.unavailable("cudnn", "float32", cuda)
    assert "no cuDNN on tpu" in ac.unavailable("cudnn", "bfloat16", tpu)
    assert ac.unavailable("xla", "float32", tpu) == ac.unavailable("blockwise", "bfloat16", tpu) == ""
    assert ac.unavailable("splash", "bfloat16", tpu) == ac.unavailable("flash", "float32", cuda) == ""
    assert "TPU kernel" in ac.unavailable("splash", "bfloat16", cuda) and "GPU kernel" in ac.unavailable(
        "flash", "bfloat16", tpu
    )


def test_mfu_peak_is_the_vendor_figure_or_the_labelled_measurement():
    peak, label = ac.mfu_peak("NVIDIA H100 80GB HBM3", measured=1e12)
    assert peak == 989e12 and "vendor" in label
    peak, label = ac.mfu_peak("cpu", measured=3e11)
    assert peak == 3e11 and "measured" in label and "no vendor figure" in label


def test_table_and_exit_code_follow_the_rows(tmp_path):
    rows = str(tmp_path / "rows.jsonl")
    assert ac.main(["table", "--rows", rows]) == 1  # nothing ran: a failure, not a pass
    assert ac.main(["record", "--rows", rows, "--check", "tests: suite", "--rc", "0", "--figure", "9 passed"]) == 0
    assert ac.main(["record", "--rows", rows, "--check", "tests: accel", "--skip", "--figure", "QUICK=1"]) == 0
    assert ac.main(["table", "--rows", rows]) == 0
    assert ac.main(["record", "--rows", rows, "--check", "attention step", "--rc", "1"]) == 0
    assert ac.main(["table", "--rows", rows]) == 1
    lines = ac.table(ac.read_rows(rows)).splitlines()
    assert [c.strip() for c in lines[0].split(" | ")] == ["check", "result", "figure", "tolerance/target"]
    assert [line.split(" | ")[1].strip() for line in lines[2:]] == ["pass", "skip", "FAIL"]
    assert ac.exit_code([ac.row("a", "pass"), ac.row("b", "skip")]) == 0


def test_moe_rows_judge_dropless_against_dense(tmp_path):
    figures = tmp_path / "moe.json"
    step = lambda tps: {"tokens_per_s": tps}  # noqa: E731
    figures.write_text(json.dumps({"dense": step(100.0), "dropless": step(75.0), "capacity": step(90.0)}))
    rows = ac.moe_rows(figures)
    assert [(r["check"], r["result"]) for r in rows] == [
        ("MoE train step, dropless", "below"),
        ("MoE train step, capacity", "pass"),
    ]
    assert "0.75x" in rows[0]["figure"] and ">= 0.8x dense" == rows[0]["target"]
    figures.write_text(json.dumps({"dense": step(100.0), "dropless": step(80.0), "capacity": step(90.0)}))
    assert ac.moe_rows(figures)[0]["result"] == "pass"


def test_no_accelerator_is_a_clear_error_unless_allowed():
    env = {k: v for k, v in os.environ.items() if k != "ALLOW_CPU"} | {"JAX_PLATFORMS": "cpu"}
    script = str(REPO / "bench" / "accelerator_check.py")
    proc = subprocess.run([sys.executable, script, "probe"], env=env, capture_output=True, text=True)
    assert proc.returncode == 3 and "JAX sees no accelerator" in proc.stderr and "jax[cuda12]" in proc.stderr
    proc = subprocess.run(
        ["bash", str(REPO / "bench" / "accelerator_check.sh")],
        env=env | {"PYTHON": "/nonexistent"},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "make install" in proc.stderr


def test_decode_rows_hold_the_engine_to_the_static_decoder_and_the_bandwidth_ceiling(tmp_path):
    figures = [
        dict(batch=1, new_tokens=256, ours_tokens_per_s=900.0, static_tokens_per_s=1000.0, before_tokens_per_s=500.0)
        | dict(idle=0.02, idle_before=0.4, weight_bytes=2**31, bandwidth_ceiling_tokens_per_s=1000.0)
        | dict(share_of_ceiling=0.9, peer_tokens_per_s=300.0, ours_vs_peer=3.0),
        dict(batch=16, new_tokens=256, ours_tokens_per_s=1100.0, static_tokens_per_s=1000.0, before_tokens_per_s=700.0)
        | dict(idle=0.01, idle_before=0.3),
    ]
    path = tmp_path / "decode.json"
    path.write_text(json.dumps(figures))
    rows = ac.decode_rows(path)
    # 0.9x static, 90% of the ceiling, 3x generate; 1.1x static, no generate measured
    assert [r["result"] for r in rows] == ["below", "pass", "pass", "pass", "skip"]
    assert "idle 2%" in rows[0]["figure"] and "idle 40%" in rows[0]["figure"]
