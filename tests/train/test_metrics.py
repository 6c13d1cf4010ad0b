"""Metrics files: JSONL rows, non-finite values kept visible, truncation on resume, the PNG."""

import math

from lm.train.metrics import MetricsWriter, plot_curves, read_metrics, truncate_after


def test_rows_truncation_and_plot(tmp_path):
    writer = MetricsWriter(tmp_path)
    for step in (10, 20, 30):
        writer.write(step, {"loss": 3.0 / step, "lr": 0.1})
    writer.write(20, {"eval_loss": 0.2})
    writer.write(40, {"loss": math.nan, "grad_norm": math.inf})
    writer.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert rows[0] == {"step": 10, "loss": 0.3, "lr": 0.1}
    assert rows[-1] == {"step": 40, "loss": "nan", "grad_norm": "inf"}
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    plot_curves(tmp_path / "metrics.jsonl", tmp_path / "loss.png", baseline=1.0)
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    truncate_after(tmp_path / "metrics.jsonl", 20)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [10, 20, 20]


def test_disabled_writer_writes_nothing(tmp_path):
    writer = MetricsWriter(tmp_path, enabled=False)
    writer.write(1, {"loss": 1.0})
    writer.close()
    assert not list(tmp_path.iterdir())
