"""`lm export`: params only, in orbax and safetensors layouts, read back by load_params."""

import json
import logging

import grain
import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from lm.cli import main
from lm.config import base_config
from lm.errors import UserError
from lm.store.checkpoint import Checkpointer
from lm.store.export import export_params
from lm.store.load import load_params
from lm.store.meta import saved_config as load_config
from lm.train.setup import build_run


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A workdir with checkpoints at steps 3 and 6 of a tiny model sharded over 8 devices."""
    root = tmp_path_factory.mktemp("run")
    c = base_config()
    c.model.update(vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=16)
    c.mesh.update(data=1, fsdp=8, tensor=1)
    run = build_run(c)
    it = iter(grain.MapDataset.range(10).repeat().to_iter_dataset())
    ckpt = Checkpointer(root / "checkpoints", 3, keep=2, config=c)
    params = {}
    for step, seed in ((3, 1), (6, 2)):
        state = run.init_state(seed)
        ckpt.save(step, state, it)
        params[step] = jax.device_get(state.params)
    ckpt.close()
    return root, params, c


def assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("name", ["params.safetensors", "exported"])
def test_export_round_trips_the_params(workdir, tmp_path, name):
    root, params, c = workdir
    out = tmp_path / name
    done = export_params(root, out)
    assert done["step"] == 6 and done["format"] == ("safetensors" if name.endswith(".safetensors") else "orbax")
    assert_same(load_params(out), params[6])
    assert load_config(out)["model"]["d_model"] == 32
    older = tmp_path / ("old_" + name)
    export_params(root, older, step=3)
    assert_same(load_params(older), params[3])


def test_safetensors_layout(workdir, tmp_path):
    root, params, c = workdir
    export_params(root, tmp_path / "p.safetensors")
    tensors = load_file(str(tmp_path / "p.safetensors"))
    assert tensors["blocks/attn/wq"].shape == (2, 32, 2, 16)  # [n_layers, d_model, n_heads, head_dim]
    assert tensors["embedding"].shape == (64, 32)
    assert set(tensors) == {
        "/".join(str(k.key) for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(params[6])[0]
    }


def test_cli_export_and_errors(workdir, tmp_path, capsys, monkeypatch):
    root, params, _ = workdir
    assert main(["export", "--workdir", str(root), "--out", str(tmp_path / "x.safetensors")]) == 0
    assert "of step 6" in capsys.readouterr().out
    monkeypatch.chdir(root.parent)  # a relative workdir, as typed on a command line
    assert main(["export", "--workdir", root.name, "--out", "rel.safetensors"]) == 0
    assert "of step 6" in capsys.readouterr().out and (root.parent / "rel.safetensors").is_file()
    assert main(["export", "--workdir", str(root), "--step", "4", "--out", str(tmp_path / "y")]) == 2
    assert "--step 4 is not in" in capsys.readouterr().err
    assert main(["export", "--workdir", str(tmp_path), "--out", str(tmp_path / "y")]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_export_refuses_a_damaged_checkpoint(workdir, tmp_path):
    root, _, _ = workdir
    copy = tmp_path / "copy"
    import shutil

    shutil.copytree(root, copy)
    meta_path = copy / "checkpoints" / "6" / "meta" / "metadata"
    meta = json.loads(meta_path.read_text())
    first_param = next(i for i, p in enumerate(meta["shapes"]) if p.startswith("params/"))
    meta["checksums"][first_param] ^= 1
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(UserError, match="does not match its saved checksum"):
        export_params(copy, tmp_path / "z.safetensors")


def test_export_carries_the_tokenizer_refuses_other_suffixes_and_logs_no_orbax_warning(workdir, tmp_path, caplog):
    root, _, _ = workdir
    (root / "tokenizer.model").write_bytes(b"a sentencepiece model")
    try:
        with caplog.at_level(logging.INFO):
            export_params(root, tmp_path / "p.safetensors")
            export_params(root, tmp_path / "dir")
    finally:
        (root / "tokenizer.model").unlink()
    assert (tmp_path / "p.tokenizer.model").read_bytes() == b"a sentencepiece model"
    assert (tmp_path / "dir" / "tokenizer.model").read_bytes() == b"a sentencepiece model"
    assert not [r for r in caplog.records if "Metadata file does not exist" in r.getMessage()]
    with pytest.raises(UserError, match=r"'\.pt' file.*\.safetensors.*without a suffix"):
        export_params(root, tmp_path / "x.pt")
    assert not (tmp_path / "x.pt").exists()
