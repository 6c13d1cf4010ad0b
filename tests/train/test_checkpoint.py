"""Checkpoints: restore onto other meshes, one layout for every remat policy, retention,
damaged checkpoints set aside, incompatible configs refused, failed saves harmless."""

import copy
import json
import pathlib
import time

import grain
import jax
import numpy as np
import pytest

from lm.config import base_config
from lm.errors import UserError
from lm.store.checkpoint import Checkpointer, IncompatibleCheckpoint
from lm.train.setup import build_run


def config(d_model=64, remat="none"):
    c = base_config()
    c.model.update(vocab_size=64, d_model=d_model, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                   max_seq_len=16, remat=remat)
    return c


def build(c, mesh_shape, devices=None):
    """The run of config c on a (data, fsdp, tensor) mesh."""
    c = copy.deepcopy(c)
    c.mesh.update(dict(zip(("data", "fsdp", "tensor"), mesh_shape)))
    return build_run(c, devices=devices)


def target(c, mesh_shape, devices=None):
    run = build(c, mesh_shape, devices)
    return run.abstract_state(), run.state_shardings


def data_iter():
    return iter(grain.MapDataset.range(1000).shuffle(seed=1).repeat().batch(2).to_iter_dataset())


def assert_trees_equal(a, b):
    la, lb = jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))
    assert jax.tree.structure(jax.device_get(a)) == jax.tree.structure(jax.device_get(b))
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A state created on 8 devices with fsdp=8, saved at steps 1 and 2, plus its host copy."""
    root = tmp_path_factory.mktemp("ckpt")
    c = config()
    state = build(c, (1, 8, 1), jax.devices()[:8]).init_state(3)
    assert len(state.params["embedding"].sharding.device_set) == 8
    ckpt = Checkpointer(root / "checkpoints", 1, keep=5, config=c)
    it = data_iter()
    for step in (1, 2):
        next(it)
        ckpt.save(step, state, it, health={"skipped_steps": step})
    ckpt.close()
    return root, c, jax.device_get(state)


@pytest.mark.parametrize("mesh_shape,n_devices", [((2, 2, 2), 8), ((1, 1, 1), 1)], ids=["mesh_2x2x2", "one_device"])
def test_restore_onto_another_mesh(saved, mesh_shape, n_devices):
    root, c, host_state = saved
    abstract, shardings = target(c, mesh_shape, jax.devices()[:n_devices])
    ckpt = Checkpointer(root / "checkpoints", 1, keep=5, config=c)
    it = data_iter()
    state, step, meta = ckpt.restore(abstract, it)
    assert step == 2 and meta["health"] == {"skipped_steps": 2}
    assert_trees_equal(state, host_state)
    for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(shardings)):
        assert leaf.sharding == sharding
    if n_devices == 8:  # really split over the new mesh, not gathered
        wq = state.params["blocks"]["attn"]["wq"]
        assert wq.addressable_shards[0].data.size < wq.size
    reference = data_iter()
    next(reference), next(reference)
    np.testing.assert_array_equal(next(it), next(reference))  # the data position came back too


def test_remat_policies_share_one_layout(tmp_path):
    a_none, _ = target(config(remat="none"), (1, 1, 1), jax.devices()[:1])
    a_full, _ = target(config(remat="full"), (1, 1, 1), jax.devices()[:1])
    shapes = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype), t)  # noqa: E731
    assert jax.tree.structure(a_none) == jax.tree.structure(a_full)
    assert shapes(a_none) == shapes(a_full)
    c = config(remat="none")
    state = build(c, (1, 1, 1), jax.devices()[:1]).init_state(5)
    host = jax.device_get(state)
    assert host.params["blocks"]["attn"]["wq"].shape[0] == c.model.n_layers  # scanned: layers stacked
    for save_remat, into in (("none", a_full), ("full", a_none)):
        ckpt = Checkpointer(tmp_path / save_remat, 1, keep=1, config=config(remat=save_remat))
        ckpt.save(1, state, data_iter())
        ckpt.close()
        state, _, _ = Checkpointer(tmp_path / save_remat, 1, keep=1).restore(into)  # saved as one, loaded as other
        assert_trees_equal(state, host)


def tiny_state(value=0.0):
    return {"w": jax.numpy.full((4, 4), float(value)), "step": jax.numpy.int32(value)}


def tiny_target():
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev), tiny_state())


def test_keep_newest_plus_every_period(tmp_path):
    ckpt = Checkpointer(tmp_path / "c", every_steps=1, keep=2, keep_period=4)
    it = data_iter()
    for step in range(1, 11):
        ckpt.save(step, tiny_state(step), it)
        ckpt.wait()
    assert ckpt.all_steps() == [4, 8, 9, 10]
    ckpt.close()


def test_due_by_steps_and_by_minutes(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    ckpt = Checkpointer(tmp_path / "c", every_steps=5, keep=2, every_minutes=2.0)
    assert [s for s in range(1, 16) if ckpt.due(s)] == [5, 10, 15]
    clock[0] += 119.0
    assert not ckpt.time_due()
    clock[0] += 1.0
    assert ckpt.time_due()
    ckpt.save(3, tiny_state(3), data_iter())
    assert not ckpt.time_due()  # the clock restarts at every save
    ckpt.close()
    assert not Checkpointer(tmp_path / "d", every_steps=0, keep=1).due(5)


def _largest_file(step_dir: pathlib.Path, under: str = "state") -> pathlib.Path:
    files = [p for p in (step_dir / under).rglob("*") if p.is_file() and "ocdbt.process" in str(p)]
    return max(files, key=lambda p: p.stat().st_size)


def _flip_bytes(path: pathlib.Path):
    raw = bytearray(path.read_bytes())
    middle = len(raw) // 2
    raw[middle:middle + 16] = bytes(b ^ 0x5A for b in raw[middle:middle + 16])
    path.write_bytes(bytes(raw))


CORRUPTIONS = {
    "deleted_file": lambda d: _largest_file(d).unlink(),
    "truncated_file": lambda d: (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]))(_largest_file(d)),
    "garbage_bytes": lambda d: _flip_bytes(_largest_file(d)),
    "missing_state_metadata": lambda d: (d / "state" / "_METADATA").unlink(),
    "missing_meta": lambda d: (d / "meta" / "metadata").unlink(),
    "garbage_data_state": lambda d: next((d / "data").glob("*.json")).write_text("{not json"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_damaged_latest_falls_back_to_previous(tmp_path, kind, capsys):
    root = tmp_path / "checkpoints"
    ckpt = Checkpointer(root, every_steps=1, keep=5)
    it = data_iter()
    for step in (1, 2):
        next(it)
        # big enough that the array data sit in their own file, not inline in the manifest
        ckpt.save(step, {"w": jax.numpy.arange(4096.0) * step, "step": jax.numpy.int32(step)}, it)
    ckpt.close()
    CORRUPTIONS[kind](root / "2")

    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    want = {"w": jax.ShapeDtypeStruct((4096,), np.float32, sharding=dev),
            "step": jax.ShapeDtypeStruct((), np.int32, sharding=dev)}
    fresh = Checkpointer(root, every_steps=1, keep=5)
    resumed_it = data_iter()
    state, step, _ = fresh.restore(want, resumed_it)
    assert step == 1 and int(state["step"]) == 1
    np.testing.assert_array_equal(np.asarray(state["w"]), np.arange(4096.0))
    out = capsys.readouterr().out
    assert "checkpoint step 2 is damaged (" in out and "rejected_checkpoints" in out, out
    assert (tmp_path / "rejected_checkpoints" / "2").is_dir() and fresh.all_steps() == [1]
    reference = data_iter()
    next(reference)
    np.testing.assert_array_equal(next(resumed_it), next(reference))
    # the run can go on and save step 2 again
    fresh.save(2, state, resumed_it)
    fresh.close()
    assert fresh.all_steps() == [1, 2]


def test_garbage_in_array_data_is_caught_by_checksums(tmp_path, capsys):
    """Bytes changed inside an uncompressed chunk decode fine; only the checksum can tell."""
    root = tmp_path / "checkpoints"
    ckpt = Checkpointer(root, every_steps=1, keep=5)
    state = {"w": jax.numpy.arange(4096.0), "step": jax.numpy.int32(1)}
    for step in (1, 2):
        ckpt.save(step, state, data_iter())
    ckpt.close()
    meta_path = root / "2" / "meta" / "metadata"
    meta = json.loads(meta_path.read_text())
    meta["checksums"][1] ^= 1  # as if the array bytes (not the record) had changed
    meta_path.write_text(json.dumps(meta))
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    want = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev), state)
    _, step, _ = Checkpointer(root, every_steps=1, keep=5).restore(want)
    assert step == 1
    assert "contents of 'w' differ from what was saved" in capsys.readouterr().out


def test_all_damaged_is_a_user_error(tmp_path):
    ckpt = Checkpointer(tmp_path / "c", every_steps=1, keep=5)
    ckpt.save(1, tiny_state(1), data_iter())
    ckpt.close()
    (tmp_path / "c" / "1" / "meta" / "metadata").unlink()
    with pytest.raises(UserError, match="no intact checkpoint.*step 1"):
        Checkpointer(tmp_path / "c", every_steps=1, keep=5).restore(tiny_target())


def test_incompatible_config_is_refused_naming_parameters(saved, tmp_path):
    root, _, _ = saved
    other = config(d_model=32)
    abstract, _ = target(other, (1, 1, 1), jax.devices()[:1])
    with pytest.raises(IncompatibleCheckpoint) as err:
        Checkpointer(root / "checkpoints", 1, keep=5, config=other).restore(abstract)
    message = str(err.value)
    assert "params/embedding: saved [64, 64] float32, now [64, 32] float32" in message
    assert "model.d_model=64 (checkpoint) vs 32 (now)" in message
    assert (root / "checkpoints" / "2").is_dir()  # a wrong config does not reject good checkpoints


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    ckpt = Checkpointer(root, every_steps=1, keep=1)
    it = data_iter()
    ckpt.save(1, tiny_state(1), it)
    ckpt.wait()

    from orbax.checkpoint._src.handlers import json_checkpoint_handler

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "async_save", disk_full)
    with pytest.raises(UserError, match=r"step 2 .*failed \(OSError.*No space left.*intact \(steps \[1\]\)"):
        ckpt.save(2, tiny_state(2), it)
        ckpt.wait()
    monkeypatch.undo()
    assert not (root / "2").exists()  # with keep=1, a half-written step 2 must not have evicted step 1
    restored, step, _ = Checkpointer(root, every_steps=1, keep=1).restore(tiny_target())
    assert step == 1 and float(restored["w"][0, 0]) == 1.0
