"""`lm sample` end to end on a tiny random-weight export, and its one-line errors."""

import json

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from lm.cli import main
from lm.config import base_config
from lm.model.params import leaf_paths
from lm.model.spec import ModelSpec
from lm.model.transformer import Transformer
from tests.model.test_transformer import random_params


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A .safetensors export (the `lm export` layout) of a random byte-level model."""
    c = base_config()
    c.model.update(
        vocab_size=264, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=48, init_std=0.3
    )
    c.data.update(tokenizer="byte", seq_len=48)
    params = random_params(Transformer(ModelSpec.from_config(c.model)), seed=1)
    path = tmp_path_factory.mktemp("export") / "tiny.safetensors"
    flat = {p: np.asarray(x) for p, x in zip(leaf_paths(params), jax.tree.leaves(params))}
    save_file(flat, str(path), metadata={"lm_config": c.to_json(), "lm_step": "0"})
    return path


def test_one_prompt_streams_and_a_prompt_file_round_trips(export, tmp_path, capsys):
    assert (
        main(["sample", "--params", str(export), "--prompt", "def f(", "--max-new-tokens", "8", "--temperature", "0"])
        == 0
    )
    out = capsys.readouterr()
    assert out.out.startswith("def f(") and len(out.out) > len("def f(") and "[length: 8 tokens]" in out.err
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(", "id": 1}) + "\n\n" + json.dumps({"prompt": "x", "id": 2}) + "\n")
    assert (
        main(
            [
                "sample",
                "--params",
                str(export),
                "--prompts",
                str(prompts),
                "--out",
                str(tmp_path / "out.jsonl"),
                "--max-new-tokens",
                "8",
                "--temperature",
                "0",
                "--batch-size",
                "2",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [1, 2] and all(len(r["tokens"]) == 8 == len(r["logprobs"]) for r in rows)
    assert out.out == "def f(" + rows[0]["completion"]  # the streamed text is the batch's text


@pytest.mark.parametrize(
    "args, words",
    [
        (["--prompt", ""], "--prompt is empty"),
        (["--prompt", "x" * 60], "longer than the model's context of 48"),
        (["--prompt", "x", "--max-new-tokens", "100"], "at most 47 new tokens fit"),
        (["--prompt", "x", "--tokenizer", "MISSING.model"], "does not exist"),
        (["--prompt", "x", "--top-p", "0"], "top_p"),
    ],
)
def test_bad_input_is_one_line(export, capsys, args, words):
    assert main(["sample", "--params", str(export), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lm: error:") and words in err and "\n" not in err, err


def test_bad_prompt_files_name_file_and_line(export, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n{not json\n")
    assert main(["sample", "--params", str(export), "--prompts", str(bad)]) == 2
    assert f"{bad}:2: not valid JSON" in capsys.readouterr().err
    bad.write_text(json.dumps({"text": "no prompt"}) + "\n")
    assert main(["sample", "--params", str(export), "--prompts", str(bad)]) == 2
    assert f'{bad}:1: expected an object with a string "prompt"' in capsys.readouterr().err


def test_a_tokenizer_larger_than_the_model_is_refused(export, tmp_path, capsys, corpus):
    assert (
        main(["tokenizer", "train", "--corpus", str(corpus), "--out", str(tmp_path / "tok"), "--vocab-size", "400"])
        == 0
    )
    capsys.readouterr()
    assert main(["sample", "--params", str(export), "--prompt", "x", "--tokenizer", str(tmp_path / "tok.model")]) == 2
    err = capsys.readouterr().err
    assert "does not match the tokenizer" in err or "not the model's tokenizer" in err


def test_a_directory_without_checkpoints_is_named_without_blaming_another_command(export, tmp_path, capsys):
    empty = tmp_path / "empty"
    (empty / "checkpoints").mkdir(parents=True)
    commands = [["sample", "--prompt", "x"], ["eval", "--tasks", "t=t.jsonl"]]
    for command in commands:
        for workdir, words in [
            (empty, f"'{empty}' holds no checkpoint"),
            (tmp_path / "gone", "does not exist"),
            (export, f"is an export, not a run directory: give it with --params '{export}'"),
        ]:
            assert main([command[0], "--workdir", str(workdir), *command[1:]]) == 2
            err = capsys.readouterr().err.strip()
            assert err.startswith("lm: error:") and words in err and "\n" not in err, err
            assert "lm export" not in err, err
    from lm.errors import UserError
    from lm.store.load import load_trained

    (empty / "checkpoints" / "5").mkdir()
    with pytest.raises(UserError, match=r"has no checkpoint of step 7 \(saved steps: \[5\]\)"):
        load_trained(workdir=str(empty), step=7)
