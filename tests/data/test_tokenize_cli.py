"""`lm tokenize` and the data section of the config: what a user types, what comes out."""

import pytest

from lm.cli import main
from lm.config import data_sources, load_config
from lm.errors import UserError


def test_tokenize_verb_writes_shards_and_reruns_as_noop(tmp_path, capsys, corpus):
    out = tmp_path / "shards"
    args = ["tokenize", "--corpus", str(corpus), "--out", str(out), "--heldout-fraction", "0.25", "--no-progress"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert "train:" in first and "heldout:" in first and f"--config.data.sources={out}" in first
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert main(args) == 0 and capsys.readouterr().out == first
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files
    bad = main(["tokenize", "--corpus", str(tmp_path / "nope"), "--out", str(out)])
    assert bad == 2 and "does not exist" in capsys.readouterr().err


def test_data_sources_config(tmp_path):
    colon = tmp_path / "x:y"
    colon.mkdir()
    c = load_config("configs/tiny.py", [f"data.sources=stdlib:3,/data/web:1.5,{colon}"])
    assert data_sources(c.data) == [("stdlib", 3.0), ("/data/web", 1.5), (str(colon), 1.0)]
    with pytest.raises(UserError, match=r"^data.sources\[0\] = 'stdlib:x': the weight after ':' must be a number"):
        load_config(None, ["data.sources=stdlib:x"])
    assert data_sources(load_config("configs/tiny.py").data) == [("stdlib", 1.0)]  # data.corpus alone
    with pytest.raises(UserError, match=r"data.sources\[1\]' = '/data/web:-2'.*weight >= 0"):
        load_config(None, ["data.sources=stdlib:1,/data/web:-2"])
    with pytest.raises(UserError, match="data.sources.*sum to a positive number"):
        load_config(None, ["data.sources=stdlib:0,/data/web:0"])
    with pytest.raises(UserError, match="data.workers"):
        load_config(None, ["data.workers=-1"])
