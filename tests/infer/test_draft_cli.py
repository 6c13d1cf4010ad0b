"""`lm sample --draft MODEL` and `lm serve --draft MODEL` speculate in the engine: the greedy text of
plain decoding, every prompt of a batch at once, drafts counted on stderr; bad flags are one line."""

import argparse
import json

import pytest

from lm.cli import main
from lm.infer.sampling import SamplingParams
from tests.infer.test_sample_cli import export  # noqa: F401  (a fixture: a tiny random export)


def test_lm_sample_with_a_draft_model_gives_the_greedy_text(export, tmp_path, capsys):  # noqa: F811
    base = ["sample", "--params", str(export), "--max-new-tokens", "10", "--temperature", "0"]
    draft = ["--draft", str(export), "--draft-k", "2"]  # the export as its own draft: its drafts are kept
    assert main([*base, "--prompt", "def f("]) == 0
    plain = capsys.readouterr().out
    assert main([*base, *draft, "--prompt", "def f("]) == 0
    streamed = capsys.readouterr()
    assert streamed.out == plain and "[length: 10 tokens; speculative: " in streamed.err
    assert "drafts kept (100%)" in streamed.err and "tokens per target pass]" in streamed.err
    prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["def f(", "ab", "x = 1"]))
    assert main([*base, *draft, "--batch-size", "2", "--prompts", str(prompts), "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert plain == "def f(" + rows[0]["completion"] and all(len(r["tokens"]) == 10 for r in rows)
    assert main([*base, *draft, "--prompt", "hi", "--chat"]) == 0
    assert "speculative: " in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--draft-k", "2"], "--draft-k needs --draft"),
        (["--draft", "ngram", "--draft-k", "0"], "k=0: expected an integer >= 1"),
        (["--draft", "MISSING"], "MISSING"),
    ],
)
def test_bad_draft_flags_are_one_line(export, capsys, extra, words):  # noqa: F811
    assert main(["sample", "--params", str(export), "--prompt", "x", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lm: error:") and words in err and "\n" not in err, err


def test_the_served_engine_speculates_with_a_draft_model(export):  # noqa: F811
    from lm.infer.serve.engine_backend import make_backend
    from lm.store.load import load_trained

    args = argparse.Namespace(
        quantize="none", speculate=0, draft=str(export), slots=2, page_size=8, max_model_len=None, model_name="tiny"
    )
    backend = make_backend(load_trained(params=str(export)), args)
    try:
        engine = backend.service.engine
        assert engine.draft is not None and engine.config.speculate == 4  # --speculate's default with --draft
        ids, _ = backend.prompt_ids(prompt="Hello")
        deltas = list(backend.submit(ids, SamplingParams(max_new_tokens=6, temperature=0), ()))
        assert sum(len(d.token_ids) for d in deltas) == 6 and deltas[-1].finish_reason == "length"
        assert engine.acceptance[1] > 0
    finally:
        backend.shutdown(cancel=True)
