"""The local checkpoint tier (lm.store.local_tier): frequent per-process saves beside the
persistent tier; a resume takes the newest complete step of either, and falls back to the
persistent tier when the local one is damaged or was written for another mesh."""

import shutil

import jax
import numpy as np
import pytest

from lm.config import load_config
from lm.errors import UserError
from lm.store.checkpoint import Checkpointer
from lm.store.local_tier import LocalTier
from tests.store.test_checkpoint import assert_trees_equal, build, config, data_iter, target


def two_tiers(root, identity=None):
    local = LocalTier(root / "local", every_steps=1, keep=2, identity=identity)
    return Checkpointer(root / "checkpoints", 2, keep=3, config=config(), identity=identity, local=local)


@pytest.fixture
def saved(tmp_path):
    """Persistent saves at steps 2 and 4, local ones at 3 and 5 (6 steps of data drawn by 6)."""
    state = build(config(), (1, 8, 1), jax.devices()[:8]).init_state(3)
    ckpt, it, states = two_tiers(tmp_path), data_iter(), {}
    for step in range(1, 6):
        next(it)
        state = jax.tree.map(lambda x: x + 1 if x.dtype == np.float32 else x, state)
        if step % 2 == 0:
            ckpt.save(step, state, it, health={"skipped_steps": step})
        elif ckpt.local_due(step):
            ckpt.save(step, state, it, health={"skipped_steps": step}, local_only=True)
        states[step] = (jax.device_get(state), next(iter([it.get_state()])))
    ckpt.close()
    return tmp_path, states


def restore(root, mesh=(1, 8, 1)):
    ckpt = two_tiers(root)
    it = data_iter()
    state, step, meta = ckpt.restore(target(config(), mesh, jax.devices()[: int(np.prod(mesh))])[0], it)
    ckpt.close()
    return state, step, meta, it


def test_the_newest_local_step_is_restored_exactly(saved, capsys):
    root, states = saved
    state, step, meta, it = restore(root)
    assert step == 5 and "restored local checkpoint step 5" in capsys.readouterr().out
    assert_trees_equal(state, states[5][0])
    assert it.get_state() == states[5][1] and meta["health"] == {"skipped_steps": 5}
    assert state.params["embedding"].sharding == target(config(), (1, 8, 1), jax.devices()[:8])[1].params["embedding"]
    assert sorted(int(p.name) for p in (root / "local").iterdir()) == [3, 5]  # the newest 2 kept


def test_a_damaged_local_step_falls_back_to_the_persistent_tier(saved, capsys):
    root, states = saved
    part = root / "local" / "5" / "process_0-of-1.bin"
    raw = bytearray(part.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    part.write_bytes(bytes(raw))
    state, step, _, it = restore(root)
    out = capsys.readouterr().out
    assert step == 4 and "local checkpoint step 5" in out and "differs from what was saved" in out
    assert_trees_equal(state, states[4][0])
    assert it.get_state() == states[4][1]


def test_another_mesh_restores_from_the_persistent_tier(saved, capsys):
    root, states = saved
    state, step, _, _ = restore(root, mesh=(2, 2, 2))
    assert step == 4 and "written for another mesh" in capsys.readouterr().out
    assert_trees_equal(state, states[4][0])


def test_a_newer_persistent_step_wins(saved):
    root, _ = saved
    shutil.rmtree(root / "local" / "5")
    assert restore(root)[1] == 4  # local 3 is older than persistent 4


def test_local_dir_needs_a_cadence():
    with pytest.raises(UserError, match=r"'checkpoint.local_every_steps' = 0: checkpoint.local_dir='/x' needs"):
        load_config("configs/tiny.py", ["checkpoint.local_dir=/x"])


@pytest.mark.slow
def test_a_run_resumes_from_its_local_tier_bitwise(tmp_path, corpus, capsys):
    """`lm train` to step 6 (persistent saves at 2, 4, 6; local at 1, 3, 5); a copy that lost its
    persistent steps 4 and 6 resumes from local step 5 and ends equal to the straight run."""
    from tests.e2e.test_cli_train import final_params, train
    from tests.store.test_checkpoint import _losses

    flags = [
        "--config.checkpoint.every_steps=2",
        "--config.checkpoint.keep=3",
        f"--config.checkpoint.local_dir={tmp_path / 'local'}",
        "--config.checkpoint.local_every_steps=1",
    ]
    assert train(tmp_path / "straight", corpus, 6, *flags) == 0
    shutil.copytree(tmp_path / "straight", tmp_path / "split")
    for step in ("4", "6"):
        shutil.rmtree(tmp_path / "split" / "checkpoints" / step)
    capsys.readouterr()
    assert train(tmp_path / "split", corpus, 6, *flags, "--resume") == 0
    assert "restored local checkpoint step 5" in capsys.readouterr().out
    assert_trees_equal(final_params(tmp_path / "split", 6), final_params(tmp_path / "straight", 6))
    assert _losses(tmp_path / "split") == _losses(tmp_path / "straight")
