"""The demo's pretraining evidence: the default recipe beside the old one, with both curves in one
plot drawn from the two runs' metrics."""

import json

from lm.demo.evidence import evidence, recipe_comparison


def _metrics(path, losses):
    rows = [{"step": 10 * (i + 1), "loss": v, "eval_loss": v + 0.1} for i, v in enumerate(losses)]
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_old_recipe_is_printed_beside_the_default_with_its_plot(tmp_path):
    _metrics(tmp_path / "new", [5.0, 4.0, 3.0])
    _metrics(tmp_path / "old", [5.0, 4.5, 3.7])
    old = recipe_comparison(tmp_path / "new", tmp_path / "old", {"eval_loss": 3.714, "unigram_baseline": 6.15})
    assert old["eval_loss"] == 3.714 and (tmp_path / "new" / "recipe_vs_old.png").stat().st_size > 0
    summary = {"pretrain": {"eval_loss": 3.033, "unigram_baseline": 6.15, "old_recipe": old}, "sft": {}}
    line = next(x for x in evidence(summary, 256).splitlines() if "recipe:" in x)
    assert "QK-norm 3.033 vs the old AdamW + warmup-cosine 3.714" in line
    assert "the default 0.681 nats/token lower" in line and line.endswith(old["plot"])
    worse = summary | {"pretrain": summary["pretrain"] | {"eval_loss": 3.8}}
    assert "the default 0.086 nats/token higher" in evidence(worse, 256)


def test_no_recipe_line_without_the_old_run():
    text = evidence({"pretrain": {"eval_loss": 3.0, "unigram_baseline": 6.15}, "sft": {}}, 256)
    assert "recipe:" not in text and "held-out loss 3.000 nats/token vs 6.150" in text
