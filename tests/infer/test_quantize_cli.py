"""`--quantize` end to end: a quantized export reads back quantized and samples what quantizing at
load does; `lm eval --quantize` scores the quantized model; one-line refusals."""

import json

import numpy as np
import pytest
from safetensors import safe_open

from lm.cli import main
from tests.infer.test_sample_cli import export  # noqa: F401 (a fixture)


def sample(capsys, params, *extra) -> str:
    assert (
        main(
            [
                "sample",
                "--params",
                str(params),
                "--prompt",
                "def f(",
                "--max-new-tokens",
                "10",
                "--temperature",
                "0",
                *extra,
            ]
        )
        == 0
    )
    return capsys.readouterr().out


def test_a_quantized_export_samples_what_quantizing_at_load_does(export, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "q4.safetensors"
    assert main(["export", "--params", str(export), "--quantize", "int4", "--out", str(out)]) == 0
    capsys.readouterr()
    with safe_open(str(out), "np") as f:
        names, meta = set(f.keys()), f.metadata()
        packed = f.get_tensor("blocks/attn/wq.q4")
    assert meta["lm_quantization"] == "int4" and "blocks/mlp/w_down.scale" in names and "blocks/attn/wq" not in names
    assert packed.dtype == np.uint8
    assert out.stat().st_size < export.stat().st_size / 4
    from_export = sample(capsys, out)
    at_load = sample(capsys, export, "--quantize", "int4")
    assert from_export == at_load and from_export != sample(capsys, export)


def test_eval_scores_the_quantized_model(export, tmp_path, capsys):  # noqa: F811
    text = tmp_path / "heldout.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 4)
    bpb = {}
    for mode in ("none", "int8"):
        report = tmp_path / f"{mode}.json"
        assert (
            main(
                [
                    "eval",
                    "--params",
                    str(export),
                    "--tasks",
                    f"heldout={text}",
                    "--quantize",
                    mode,
                    "--out",
                    str(report),
                    "--no-progress",
                ]
            )
            == 0
        )
        data = json.loads(report.read_text())
        bpb[mode] = data["tasks"]["heldout"]["metrics"]["bits_per_byte"]
        assert data.get("quantize", "none") == mode
    capsys.readouterr()
    assert bpb["int8"] != bpb["none"] and bpb["int8"] == pytest.approx(bpb["none"], rel=0.05)


def test_refusals(export, tmp_path, capsys):  # noqa: F811
    assert main(["export", "--params", str(export), "--quantize", "int8", "--out", str(tmp_path / "dir")]) == 2
    assert "expected a file ending in .safetensors" in capsys.readouterr().err
    # a draft model speculates in the engine, quantized like the target (refused before it moved there)
    assert (
        main(
            [
                "sample",
                "--params",
                str(export),
                "--prompt",
                "x",
                "--quantize",
                "int8",
                "--draft",
                str(export),
                "--max-new-tokens",
                "8",
            ]
        )
        == 0
    )
    assert "drafts kept" in capsys.readouterr().err


def test_int8_kv_pages_sample(export, capsys):  # noqa: F811
    text = sample(capsys, export, "--kv-cache", "int8")
    assert text.startswith("def f(") and len(text) > len("def f(")
