"""Output paths: an existing --out is refused unless --overwrite, and with it only what the verb
writes is replaced; a run's workdir is never an output; an unwritable --out is one line before any
work; files get the umask's mode; an interrupted write leaves the old file."""

import json
import os
import pathlib
import stat

import numpy as np
import pytest

from lm.cli import main
from lm.errors import UserError
from lm.outputs import atomic_open, check_out, replacing, write_text


@pytest.fixture
def umask022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def one_line_error(capsys, *parts: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("lm: error: "), err
    for part in parts:
        assert part in lines[0], err
    return lines[0]


def leftovers(directory) -> list[str]:
    return sorted(p.name for p in pathlib.Path(directory).iterdir() if p.name.endswith(".tmp"))


# ---- the module itself


def test_check_out_refuses_in_one_line(tmp_path):
    (tmp_path / "old.json").write_text("{}")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError, match="already exists; add --overwrite"):
        check_out(tmp_path / "old.json")
    assert check_out(tmp_path / "old.json", overwrite=True) == tmp_path / "old.json"
    with pytest.raises(UserError, match="'.*afile' is a file, not a directory"):
        check_out(tmp_path / "afile" / "deeper" / "x.json")
    with pytest.raises(UserError, match="is a directory; expected a file"):
        check_out(tmp_path)
    with pytest.raises(UserError, match="--out is empty"):
        check_out("")
    with pytest.raises(UserError, match="not empty; add --overwrite"):
        check_out(tmp_path, kind="dir")
    with pytest.raises(UserError, match="exists and is not a directory"):
        check_out(tmp_path / "afile", overwrite=True, kind="dir")
    check_out(tmp_path / "new" / "dir", kind="dir")  # missing folders are made when written


def test_a_workdir_and_everything_in_it_are_never_outputs(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "10").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    for out in (
        run,
        run / "checkpoints",
        run / "checkpoints" / "10" / "x",
        run / "config.json",
        run / "params.safetensors",
        run / "hf",
    ):
        with pytest.raises(UserError, match="run's"):
            check_out(out, overwrite=True, kind="dir")
    check_out(tmp_path / "run-params.safetensors")  # beside the run is fine
    check_out(tmp_path / "run-hf", kind="dir")


def test_an_interrupted_write_leaves_the_old_file(tmp_path):
    out = tmp_path / "results.jsonl"
    out.write_text("old\n")
    with pytest.raises(KeyboardInterrupt):
        with atomic_open(out) as f:
            f.write("half of the new")
            raise KeyboardInterrupt
    assert out.read_text() == "old\n" and leftovers(tmp_path) == []
    with pytest.raises(RuntimeError):
        with replacing(tmp_path / "folder", directory=True) as tmp:
            tmp.mkdir()
            (tmp / "a").write_text("a")
            raise RuntimeError("stopped")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.jsonl"]
    write_text(out, "new\n")
    assert out.read_text() == "new\n" and leftovers(tmp_path) == []


def test_files_get_the_umask_mode(tmp_path, umask022):
    from safetensors.numpy import save_file

    from lm.data.tokens import write_json
    from lm.store.safetensors_files import write_sharded, write_streamed

    with replacing(tmp_path / "lib.safetensors") as tmp:  # safetensors itself creates files 0600
        save_file({"a": np.zeros(3, np.float32)}, str(tmp))
    write_streamed(tmp_path / "streamed.safetensors", [("a", np.zeros(3, np.float32))])
    write_json(tmp_path / "report.json", {"a": 1})  # curate's report.json, shard manifests
    write_text(tmp_path / "eval.json", "{}")
    assert {p.name: mode(p) for p in tmp_path.iterdir()} == {
        "lib.safetensors": 0o644,
        "streamed.safetensors": 0o644,
        "report.json": 0o644,
        "eval.json": 0o644,
    }
    hf = tmp_path / "hf"  # shards: the new ones in place, the old ones gone, nothing else touched
    hf.mkdir()
    (hf / "keep.txt").write_text("mine")
    tensors = [(f"t{i}", np.ones(1000, np.float32)) for i in range(3)]
    assert len(write_sharded(hf, tensors, max_bytes=4000)) == 4
    assert write_sharded(hf, tensors) == ["model.safetensors"]
    assert sorted(p.name for p in hf.iterdir()) == ["keep.txt", "model.safetensors"]
    assert mode(hf / "model.safetensors") == 0o644


# ---- the verbs


def export(*args) -> int:
    return main(["export", *args])


def test_export_keeps_what_it_did_not_write(small_base, tmp_path, capsys, umask022):
    from lm.store.load import load_params

    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    (d / "keep.txt").write_text("x")
    assert export("--workdir", str(small_base), "--out", str(d)) == 2
    one_line_error(capsys, f"--out {d}", "--overwrite")
    for _ in range(2):  # a second export replaces the first one's params/ whole
        assert export("--workdir", str(small_base), "--out", str(d), "--overwrite") == 0
    assert (d / "keep.txt").read_text() == "x" and (d / "sub").is_dir()
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "export.json", "keep.txt", "params", "sub"]
    assert "blocks" in load_params(d)
    assert mode(d / "config.json") == 0o644
    single = tmp_path / "m.safetensors"
    assert export("--workdir", str(small_base), "--out", str(single)) == 0
    assert mode(single) == 0o644
    assert export("--workdir", str(small_base), "--out", str(single)) == 2
    one_line_error(capsys, "already exists; add --overwrite")
    assert export("--workdir", str(small_base), "--out", str(single), "--overwrite") == 0


def test_an_export_over_an_earlier_one_leaves_no_tokenizer_of_another_kind(tmp_path):
    """With --overwrite, a byte model over a sentencepiece export (or a sentencepiece one over an HF
    export) must not leave the earlier tokenizer beside it: it would be read back with the new model."""
    from lm.store.export import _keep_tokenizer

    beside = tmp_path / "m.tokenizer"
    spm = tmp_path / "m.tokenizer.model"
    spm.write_bytes(b"earlier")
    (tmp_path / "keep.txt").write_text("x")
    _keep_tokenizer(None, beside)  # the byte tokenizer
    assert not spm.exists() and (tmp_path / "keep.txt").exists()
    hf = tmp_path / "hf-tokenizer"
    hf.mkdir()
    (hf / "tokenizer.json").write_text("{}")
    _keep_tokenizer(hf, beside)
    assert (beside / "tokenizer.json").read_text() == "{}"
    source = tmp_path / "t.model"
    source.write_bytes(b"spm")
    _keep_tokenizer(source, beside)
    assert spm.read_bytes() == b"spm" and not beside.exists()


def test_export_never_writes_over_a_run(small_base, tmp_path, capsys):
    before = sorted(p.name for p in small_base.iterdir())
    for out in (small_base, small_base / "checkpoints" / "x"):
        assert export("--workdir", str(small_base), "--format", "orbax", "--out", str(out), "--overwrite") == 2
        one_line_error(capsys, "run's")
    assert sorted(p.name for p in small_base.iterdir()) == before
    (tmp_path / "afile").write_text("x")
    bad = tmp_path / "afile" / "m.safetensors"
    assert export("--workdir", str(small_base), "--out", str(bad)) == 2
    one_line_error(capsys, f"--out {bad}", "is a file, not a directory")


def test_hf_and_peft_files_get_the_umask_mode_and_keep_the_rest(tmp_path, umask022):
    import flax.linen as nn
    import jax

    from lm.config import base_config
    from lm.data.tokenizer import load_tokenizer
    from lm.model.spec import ModelSpec
    from lm.model.transformer import Transformer, init_params
    from lm.store.hf.export import export_hf, export_peft
    from lm.store.loaded import Loaded

    c = base_config()
    c.model.update(
        vocab_size=259, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=32, lora_rank=2
    )
    params = nn.unbox(init_params(Transformer(ModelSpec.from_config(c.model)), jax.random.PRNGKey(0)))
    model = Loaded(c, params, load_tokenizer("byte"), "tiny")
    for out, write in (
        (tmp_path / "hf", lambda o: export_hf(model, o, merge=True)),
        (tmp_path / "adapter", lambda o: export_peft(model, o)),
    ):
        out.mkdir()
        (out / "keep.txt").write_text("x")
        write(out)
        weights = out / ("model.safetensors" if out.name == "hf" else "adapter_model.safetensors")
        assert (
            mode(weights) == 0o644
            and mode(out / "config.json" if out.name == "hf" else out / "adapter_config.json") == 0o644
        )
        assert (out / "keep.txt").read_text() == "x" and leftovers(out) == []


def test_import_refuses_before_reading(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))  # never read: --out is refused first
    (tmp_path / "old.safetensors").write_text("x")
    assert main(["import", "hf", str(hf), "--out", str(tmp_path / "old.safetensors")]) == 2
    one_line_error(capsys, "already exists; add --overwrite")
    (tmp_path / "afile").write_text("x")
    assert main(["import", "hf", str(hf), "--out", str(tmp_path / "afile" / "x")]) == 2
    one_line_error(capsys, "is a file, not a directory")


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "def"}\n{"prompt": "import"}\n')
    return path


def sample(run, prompts, out, *extra) -> int:
    return main(
        [
            "sample",
            "--workdir",
            str(run),
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "--max-new-tokens",
            "2",
            "--temperature",
            "0",
            *extra,
        ]
    )


def test_sample_refuses_replaces_and_survives_an_interrupt(small_base, prompts, tmp_path, capsys, monkeypatch):
    import lm.infer.cli as infer_cli

    out = tmp_path / "out.jsonl"
    out.write_text("earlier results\n")
    assert sample(small_base, prompts, out) == 2
    one_line_error(capsys, f"--out {out}", "already exists; add --overwrite")
    (tmp_path / "afile").write_text("x")
    assert sample(small_base, prompts, tmp_path / "afile" / "o.jsonl") == 2
    one_line_error(capsys, "is a file, not a directory")
    plain = infer_cli._Generate

    def interrupted(args, loaded, sampling):
        def generate(prompts, **kw):
            yield {"text": "x", "finish_reason": "length", "ids": [1], "logprobs": [0.0]}
            raise KeyboardInterrupt

        return generate

    monkeypatch.setattr(infer_cli, "_Generate", interrupted)
    assert sample(small_base, prompts, out, "--overwrite") == 130
    assert out.read_text() == "earlier results\n" and leftovers(tmp_path) == []
    monkeypatch.setattr(infer_cli, "_Generate", plain)
    assert sample(small_base, prompts, out, "--overwrite") == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["def", "import"] and leftovers(tmp_path) == []


def test_eval_checks_out_before_scoring(small_base, tmp_path, capsys, umask022):
    task = tmp_path / "held.jsonl"
    task.write_text('{"text": "def add(a, b):\\n    return a + b\\n"}\n')
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "r.json"
    args = ["eval", "--workdir", str(small_base), "--no-progress", "--tasks", f"held={task}", "--out"]
    assert main([*args, str(tmp_path / "afile" / "r.json")]) == 2
    one_line_error(capsys, "is a file, not a directory")
    out.write_text("old")
    assert main([*args, str(out)]) == 2
    one_line_error(capsys, "already exists; add --overwrite")
    assert main([*args, str(out), "--overwrite"]) == 0
    assert "held" in json.loads(out.read_text())["tasks"] and mode(out) == 0o644


def test_reward_score_and_harness_refuse_an_existing_out(small_base, tmp_path, capsys):
    out = tmp_path / "scores.jsonl"
    out.write_text("old")
    assert (
        main(["reward", "score", "--workdir", str(small_base), "--texts", str(tmp_path / "t.jsonl"), "--out", str(out)])
        == 2
    )
    one_line_error(capsys, "already exists; add --overwrite")
    assert main(["harness", "--workdir", str(small_base), "--tasks", "x", "--out", str(out)]) == 2
    one_line_error(capsys, "already exists; add --overwrite")
    assert out.read_text() == "old"


def test_tokenizer_train_refuses_and_replaces(corpus, tmp_path, capsys, umask022):
    prefix = tmp_path / "tok"
    (tmp_path / "tok.vocab").write_text("old")
    args = [
        "tokenizer",
        "train",
        "--corpus",
        str(corpus),
        "--out",
        str(prefix),
        "--vocab-size",
        "500",
        "--max-bytes",
        "100000",
    ]
    assert main(args) == 2
    one_line_error(capsys, "tok.vocab: already exists; add --overwrite")
    assert main([*args, "--overwrite"]) == 0
    assert (tmp_path / "tok.vocab").read_text() != "old"
    assert mode(tmp_path / "tok.model") == mode(tmp_path / "tok.vocab") == 0o644


@pytest.mark.parametrize("target", [None, ""])
def test_plan_fit_needs_a_target(target, capsys):
    argv = ["plan", "--fit"] + ([] if target is None else ["--target", target])
    assert main(argv) == 2
    one_line_error(capsys, "--fit needs --target")


def test_contamination_report_says_na_for_examples_too_short(tmp_path, capsys):
    task = tmp_path / "sort.jsonl"
    task.write_text('{"prompt": "sort 3 1", "answer": "1 3"}\n{"prompt": "sort 2 5", "answer": "2 5"}\n')
    (tmp_path / "train.txt").write_text("sort 3 1 1 3 and many other words of training text here")
    report = {
        "model": "m",
        "tasks": {
            "sort": {
                "kind": "gen",
                "path": str(task),
                "n": 2,
                "metrics": {},
                "example_ids": [1, 2],
                "per_example": {"exact": [1.0, 0.0]},
            }
        },
    }
    (tmp_path / "eval.json").write_text(json.dumps(report))
    out = tmp_path / "c.json"
    assert (
        main(
            [
                "contamination",
                "--train",
                str(tmp_path / "train.txt"),
                "--eval",
                str(task),
                "--report",
                str(tmp_path / "eval.json"),
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "sort: clean 0, contaminated 0, n/a: too short 2" in printed and "clean 2" not in printed
    assert "clean n/a: too short" in printed
    clean = json.loads(out.read_text())["clean"]["sort"]
    assert (clean["n_clean"], clean["n_contaminated"], clean["n_too_short"]) == (0, 0, 2)
    assert (
        main(
            [
                "contamination",
                "--train",
                str(tmp_path / "train.txt"),
                "--eval",
                str(task),
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 2
    )
    one_line_error(capsys, "already exists; add --overwrite")
