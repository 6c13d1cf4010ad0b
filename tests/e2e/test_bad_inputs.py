"""Bad input over every verb: each row is a command and the one line `lm` must answer with (exit 2,
`lm: error: ...` on stderr, no traceback, nothing else on stderr). Rows are only ever added: the
count of checked bad inputs grows with every edge that is closed.

A row's argv may name `{tmp}` (an empty directory of its own), `{run}` (a small trained run,
shared: never written to), `{hf}` (a tiny Hugging Face directory with its tokenizer, shared:
never written to); `prepare(tmp)` writes the files a row needs into its own directory first.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Callable

import pytest

from lm import cli


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    argv: tuple[str, ...]
    expect: str  # a part of the one error line
    prepare: Callable[[pathlib.Path], None] | None = None


def _write(name: str, text: str) -> Callable[[pathlib.Path], None]:
    def prepare(tmp: pathlib.Path) -> None:
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    return prepare


def _hf_model(corrupt: Callable[[pathlib.Path], None]) -> Callable[[pathlib.Path], None]:
    """prepare: a tiny random Llama with its tokenizer in {tmp}/m, then `corrupt(m)`."""

    def prepare(tmp: pathlib.Path) -> None:
        from tests.hf_models import write_model, write_tokenizer

        write_model("llama3", tmp / "m")
        write_tokenizer(tmp / "m")
        corrupt(tmp / "m")

    return prepare


def _hf_config(**change) -> Callable[[pathlib.Path], None]:
    def corrupt(m: pathlib.Path) -> None:
        config = json.loads((m / "config.json").read_text()) | change
        (m / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))

    return corrupt


def _hf_header(header: bytes, length: int | None = None) -> Callable[[pathlib.Path], None]:
    def corrupt(m: pathlib.Path) -> None:
        import struct

        n = len(header) if length is None else length
        (m / "model.safetensors").write_bytes(struct.pack("<Q", n) + header + b"\0" * 64)

    return corrupt


def _hf_tensor(name: str, change: Callable) -> Callable[[pathlib.Path], None]:
    def corrupt(m: pathlib.Path) -> None:
        from safetensors.numpy import load_file, save_file

        tensors = load_file(m / "model.safetensors")
        tensors[name] = change(tensors[name])
        save_file(tensors, m / "model.safetensors")

    return corrupt


def _hf_index(m: pathlib.Path) -> None:
    (m / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.norm.weight"]}))


def _with_nan(x):
    x = x.copy()
    x.flat[7] = float("nan")
    return x


CASES: list[Case] = [
    Case(
        "sample: missing prompts file",
        ("sample", "--workdir", "{run}", "--prompts", "{tmp}/none.jsonl"),
        "--prompts {tmp}/none.jsonl: no such file",
    ),
    Case(
        "sample: prompts line not JSON",
        ("sample", "--workdir", "{run}", "--prompts", "{tmp}/p.jsonl"),
        "{tmp}/p.jsonl:2",
        _write("p.jsonl", '{"prompt": "a"}\n{oops\n'),
    ),
    Case("sample: empty prompt", ("sample", "--workdir", "{run}", "--prompt", ""), "--prompt is empty"),
    Case(
        "export: unknown suffix", ("export", "--workdir", "{run}", "--out", "{tmp}/x.bin"), "is neither form lm writes"
    ),
    Case(
        "import: not an HF directory",
        ("import", "hf", "{tmp}", "--out", "{tmp}/out"),
        "is not a Hugging Face model directory",
    ),
    Case("plan: unknown step", ("plan", "--steps", "nope"), "--steps nope: unknown"),
    Case(
        "config override without value",
        ("train", "--workdir", "{tmp}/w", "--config.optim.lr"),
        "override '--config.optim.lr' has no value",
    ),
    Case(
        "export: --out exists",
        ("export", "--workdir", "{run}", "--out", "{tmp}/m.safetensors"),
        "--out {tmp}/m.safetensors: already exists; add --overwrite",
        _write("m.safetensors", "x"),
    ),
    Case(
        "export: --out a directory with other files",
        ("export", "--workdir", "{run}", "--out", "{tmp}/d"),
        "the directory exists and is not empty; add --overwrite",
        _write("d/keep.txt", "x"),
    ),
    Case(
        "export: --out is the run's workdir",
        ("export", "--workdir", "{run}", "--format", "orbax", "--out", "{run}", "--overwrite"),
        "--out {run}: is a run's workdir",
    ),
    Case(
        "export: --out in the run's checkpoints",
        ("export", "--workdir", "{run}", "--format", "hf", "--out", "{run}/checkpoints/hf", "--overwrite"),
        "is inside the run's workdir",
    ),
    Case(
        "export: --out a new name inside the run's workdir",
        ("export", "--workdir", "{run}", "--out", "{run}/params.safetensors"),
        "is inside the run's workdir",
    ),
    Case(
        "export: --out under a file",
        ("export", "--workdir", "{run}", "--out", "{tmp}/f/m.safetensors"),
        "'{tmp}/f' is a file, not a directory",
        _write("f", "x"),
    ),
    Case(
        "import: --out under a file",
        ("import", "hf", "{tmp}/hf", "--out", "{tmp}/hf/config.json/x"),
        "is a file, not a directory",
        _write("hf/config.json", '{"model_type": "llama"}'),
    ),
    Case(
        "import: --out a directory with other files",
        ("import", "hf", "{tmp}/hf", "--out", "{tmp}"),
        "not empty; add --overwrite",
        _write("hf/config.json", '{"model_type": "llama"}'),
    ),
    Case(
        "sample: --out exists",
        ("sample", "--workdir", "{run}", "--prompts", "{tmp}/p.jsonl", "--out", "{tmp}/o.jsonl"),
        "--out {tmp}/o.jsonl: already exists",
        _write("o.jsonl", "x"),
    ),
    Case(
        "sample: --out under a file",
        ("sample", "--workdir", "{run}", "--prompts", "{tmp}/p.jsonl", "--out", "{tmp}/f/o.jsonl"),
        "is a file, not a directory",
        _write("f", "x"),
    ),
    Case(
        "sample: --out with one --prompt",
        ("sample", "--workdir", "{run}", "--prompt", "a", "--out", "{tmp}/o"),
        "--out writes the results of --prompts",
    ),
    Case(
        "eval: --out under a file",
        ("eval", "--workdir", "{run}", "--tasks", "{tmp}/t.jsonl", "--out", "{tmp}/f/r.json"),
        "'{tmp}/f' is a file, not a directory",
        _write("f", "x"),
    ),
    Case(
        "eval: --compare --out exists",
        ("eval", "--compare", "{tmp}/a.json", "{tmp}/a.json", "--out", "{tmp}/a.json"),
        "--out {tmp}/a.json: already exists",
        _write("a.json", "{}"),
    ),
    Case(
        "harness: --out under a file",
        ("harness", "--workdir", "{run}", "--tasks", "x", "--out", "{tmp}/f/r.json"),
        "is a file, not a directory",
        _write("f", "x"),
    ),
    Case(
        "contamination: --out exists",
        ("contamination", "--train", "stdlib", "--eval", "{tmp}/e.jsonl", "--out", "{tmp}/e.jsonl"),
        "--out {tmp}/e.jsonl: already exists",
        _write("e.jsonl", '{"text": "a b"}\n'),
    ),
    Case(
        "tokenizer train: --out files exist",
        ("tokenizer", "train", "--out", "{tmp}/tok"),
        "--out {tmp}/tok.model: already exists; add --overwrite",
        _write("tok.model", "x"),
    ),
    Case("tokenizer train: --out not a prefix", ("tokenizer", "train", "--out", "{tmp}/"), "expected a file prefix"),
    Case(
        "reward score: --out under a file",
        ("reward", "score", "--workdir", "{run}", "--texts", "{tmp}/t.jsonl", "--out", "{tmp}/f/s.jsonl"),
        "is a file, not a directory",
        _write("f", "x"),
    ),
    Case("plan: --fit without --target", ("plan", "--fit"), "--fit needs --target"),
    Case("plan: --compile with an empty --target", ("plan", "--compile", "--target", ""), "--compile needs --target"),
    Case(
        "tokenize: --out is a file", ("tokenize", "--out", "{tmp}/f"), "exists and is not a directory", _write("f", "x")
    ),
    Case("tokenize: --out is a run's workdir", ("tokenize", "--out", "{run}"), "is a run's workdir"),
    Case(
        "curate: --out holds the input",
        ("curate", "--input", "{tmp}/in", "--out", "{tmp}"),
        "holds the --input {tmp}/in",
        _write("in/a.txt", "some text"),
    ),
    Case(
        "sample: --tokenizer not the HF directory's own",
        ("sample", "--params", "{hf}", "--tokenizer", "byte", "--prompt", "w3"),
        "--tokenizer byte does not match the tokenizer of '{hf}'",
    ),
    Case(
        "sample: --tokenizer not the run's own",
        ("sample", "--workdir", "{run}", "--tokenizer", "{hf}", "--prompt", "a"),
        "--tokenizer {hf} does not match the tokenizer of run '{run}'",
    ),
    Case(
        "import hf: safetensors header entry not an object",
        ("import", "hf", "{tmp}/m", "--out", "{tmp}/o"),
        "tensor 'model.norm.weight': header entry is a list",
        _hf_model(_hf_header(b'{"model.norm.weight": [1, 2]}')),
    ),
    Case(
        "import hf: safetensors header a list",
        ("import", "hf", "{tmp}/m", "--out", "{tmp}/o"),
        "safetensors header is a JSON list",
        _hf_model(_hf_header(b"[1, 2]")),
    ),
    Case(
        "import hf: absurd safetensors header length",
        ("import", "hf", "{tmp}/m", "--out", "{tmp}/o"),
        "not a safetensors file (header length 1152921504606846976",
        _hf_model(_hf_header(b"{}", 2**60)),
    ),
    Case(
        "import hf: index weight_map a list",
        ("import", "hf", "{tmp}/m", "--out", "{tmp}/o"),
        "model.safetensors.index.json: 'weight_map' is list; expected an object",
        _hf_model(_hf_index),
    ),
    Case(
        "import hf: heads do not divide the width",
        ("import", "hf", "{tmp}/m", "--out", "{tmp}/o"),
        "'num_attention_heads' = 3: expected a divisor of hidden_size=64",
        _hf_model(_hf_config(num_attention_heads=3, num_key_value_heads=1, head_dim=None)),
    ),
    Case(
        "import hf: negative layer count",
        ("import", "hf", "{tmp}/m", "--out", "{tmp}/o"),
        "'num_hidden_layers' = -1: expected a positive integer",
        _hf_model(_hf_config(num_hidden_layers=-1)),
    ),
    Case(
        "import hf: top-level partial_rotary_factor",
        ("import", "hf", "{tmp}/m", "--out", "{tmp}/o"),
        "'partial_rotary_factor' = 0.5 is not supported",
        _hf_model(_hf_config(partial_rotary_factor=0.5)),
    ),
    Case(
        "import hf: tensor of the right size, wrong shape",
        ("import", "hf", "{tmp}/m", "--out", "{tmp}/o"),
        "tensor 'model.layers.1.mlp.up_proj.weight' has shape (64, 96); config.json implies (96, 64)",
        _hf_model(_hf_tensor("model.layers.1.mlp.up_proj.weight", lambda x: x.T.copy())),
    ),
    Case(
        "import hf: NaN weight",
        ("import", "hf", "{tmp}/m", "--out", "{tmp}/o"),
        "tensor 'model.layers.2.self_attn.k_proj.weight' holds non-finite values",
        _hf_model(_hf_tensor("model.layers.2.self_attn.k_proj.weight", _with_nan)),
    ),
    Case(
        "curate: every document dropped",
        ("curate", "--input", "{tmp}/in", "--out", "{tmp}/out", "--no-progress"),
        "curation kept no documents of --input '{tmp}/in': all 2 were dropped: read dropped 2 (empty 2); "
        "see {tmp}/out/report.json",
        lambda tmp: [_write(f"in/{n}.txt", "  \n")(tmp) for n in "ab"],
    ),
]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny random Llama with a tokenizer, as save_pretrained writes them."""
    from tests.hf_models import write_model, write_tokenizer

    out = tmp_path_factory.mktemp("hf") / "llama"
    write_model("llama3", out)
    write_tokenizer(out)
    return out


def _needs(case: Case, name: str) -> bool:
    return any("{" + name + "}" in a for a in case.argv)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_one_line(case, tmp_path, request, capsys, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")  # a verb sets its CPU flags; restored after the test
    places = {"tmp": str(tmp_path)}
    if _needs(case, "run"):
        places["run"] = str(request.getfixturevalue("small_base"))
    if _needs(case, "hf"):
        places["hf"] = str(request.getfixturevalue("hf_dir"))
    if case.prepare is not None:
        case.prepare(tmp_path)
    argv = [a.format(**places) for a in case.argv]
    capsys.readouterr()  # what making the shared fixtures printed
    assert cli.main(argv) == 2, argv
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("lm: error: "), err
    assert case.expect.format(**places) in lines[0], err


def test_the_table_only_grows():
    """Names are unique (a row is never replaced by another of the same name), and none was dropped."""
    names = [c.name for c in CASES]
    assert len(names) == len(set(names)) and len(names) >= 42  # raise with every row added
