"""Checkpoints: restore onto other meshes, one layout for every remat policy, retention,
damaged checkpoints set aside (any item: arrays, data position, RL prompt stream, meta),
incompatible configs refused, failed saves harmless and reported under their own step."""

import copy
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import grain
import jax
import numpy as np
import pytest

from lm.config import base_config
from lm.errors import UserError
from lm.store.checkpoint import Checkpointer, IncompatibleCheckpoint
from lm.store.checkpoint_checks import _json_digest, seal
from lm.store.checkpoint_read import saved_steps
from lm.train.setup import build_run


def config(d_model=64, remat="none"):
    c = base_config()
    c.model.update(
        vocab_size=64, d_model=d_model, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=16, remat=remat
    )
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
    raw[middle : middle + 16] = bytes(b ^ 0x5A for b in raw[middle : middle + 16])
    path.write_bytes(bytes(raw))


def _cut(path: pathlib.Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


def _edit_json(path: pathlib.Path, edit) -> None:
    value = json.loads(path.read_text())
    edit(value)
    path.write_text(json.dumps(value, indent=4))


def _shift_data_position(step_dir: pathlib.Path) -> None:
    """One digit of the data state changed: still valid JSON, another position in the data."""
    path = step_dir / "data" / "process_0-of-1.json"
    text, n = re.subn(r'"next_index": (\d+)', lambda m: f'"next_index": {int(m.group(1)) + 1}', path.read_text(), 1)
    assert n == 1, text
    path.write_text(text)


def _unseal(step_dir: pathlib.Path, edit) -> None:
    """Changes the meta item and records a matching digest: only the item it describes can tell."""

    def resealed(meta):
        edit(meta)
        body = {k: v for k, v in meta.items() if k != "meta_checksum"}
        meta.clear(), meta.update(seal(body))

    _edit_json(step_dir / "meta" / "metadata", resealed)


# corruption -> what the warning must say
CORRUPTIONS = {
    "deleted_file": (lambda d: _largest_file(d).unlink(), r"state array 'w': file '2/state/\S+' is missing"),
    "truncated_file": (
        lambda d: _cut(_largest_file(d), _largest_file(d).stat().st_size // 2),
        r"state array 'w': file '2/state/ocdbt.process_0/d/\w+' is truncated \(\d+ of \d+ bytes\)",
    ),
    "garbage_bytes": (lambda d: _flip_bytes(_largest_file(d)), "state array 'w'"),
    "missing_state_metadata": (lambda d: (d / "state" / "_METADATA").unlink(), "_METADATA"),
    "missing_meta": (lambda d: (d / "meta" / "metadata").unlink(), "meta '2/meta/metadata' is missing"),
    "garbage_data_state": (
        lambda d: next((d / "data").glob("*.json")).write_text("{not json"),
        "data state '2/data/process_0-of-1.json' is not valid JSON",
    ),
    "changed_data_position": (
        _shift_data_position,
        r"data state '2/data/process_0-of-1.json' differs from what was saved \(sha256",
    ),
    "missing_data_state": (
        lambda d: (d / "data" / "process_0-of-1.json").unlink(),
        "data state '2/data/process_0-of-1.json' is missing",
    ),
    "changed_fault_counters": (
        lambda d: _edit_json(d / "meta" / "metadata", lambda m: m["health"].update(skipped_steps=0)),
        r"meta '2/meta/metadata' \(config, shapes, checksums, fault counters\) differs",
    ),
    "meta_of_another_step": (
        lambda d: _unseal(d, lambda m: m.update(step=1)),
        "meta '2/meta/metadata' belongs to step 1",
    ),
    "truncated_index": (
        lambda d: _cut(next((d / "state" / "d").iterdir()), 10),
        r"state index: file '2/state/d/\w+' is truncated \(10 of \d+ bytes\)",
    ),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_damaged_latest_falls_back_to_previous(tmp_path, kind, capsys):
    root = tmp_path / "checkpoints"
    ckpt = Checkpointer(root, every_steps=1, keep=5)
    it = data_iter()
    for step in (1, 2):
        next(it)
        # big enough that the array data sit in their own file, not inline in the manifest
        ckpt.save(
            step,
            {"w": jax.numpy.arange(4096.0) * step, "step": jax.numpy.int32(step)},
            it,
            health={"skipped_steps": step},
        )
    ckpt.close()
    damage, said = CORRUPTIONS[kind]
    damage(root / "2")

    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    want = {
        "w": jax.ShapeDtypeStruct((4096,), np.float32, sharding=dev),
        "step": jax.ShapeDtypeStruct((), np.int32, sharding=dev),
    }
    fresh = Checkpointer(root, every_steps=1, keep=5)
    resumed_it = data_iter()
    state, step, meta = fresh.restore(want, resumed_it)
    assert step == 1 and int(state["step"]) == 1 and meta["health"] == {"skipped_steps": 1}
    np.testing.assert_array_equal(np.asarray(state["w"]), np.arange(4096.0))
    out = capsys.readouterr().out
    (line,) = out.splitlines()  # one line per rejected checkpoint
    assert line.startswith("lm: warning: checkpoint step 2 is damaged (") and "rejected_checkpoints" in line, out
    assert re.search(said, line), line
    assert (tmp_path / "rejected_checkpoints" / "2").is_dir() and fresh.all_steps() == [1]
    reference = data_iter()
    next(reference)
    np.testing.assert_array_equal(next(resumed_it), next(reference))
    # the run can go on and save step 2 again
    fresh.save(2, state, resumed_it)
    fresh.close()
    assert fresh.all_steps() == [1, 2]


def test_an_array_that_fails_while_orbax_reads_it_is_named_with_its_file(tmp_path):
    """A read error past the file checks (TensorStore's own words, under orbax's unreadable
    repr) still comes out as one line naming the array and the file."""
    from lm.store.checkpoint_checks import describe

    ckpt = Checkpointer(tmp_path / "checkpoints", every_steps=1, keep=5)
    ckpt.save(2, {"w": jax.numpy.arange(4096.0), "step": jax.numpy.int32(2)}, data_iter())
    ckpt.close()
    step_dir = tmp_path / "checkpoints" / "2"
    big = _largest_file(step_dir)
    big.write_bytes(big.read_bytes()[:100])
    try:
        try:
            raise ValueError(
                f'OUT_OF_RANGE: Error reading "w/0" in OCDBT database at local file "{step_dir}/state/": '
                "Requested byte range [0, 10169) is not valid for value of size 100"
            )
        except ValueError as inner:
            raise Exception(
                "Encountered error while reading array index: (slice(0, 4096, 1),). See full TensorStore "
                "details: <bound method pybind11_detail_function_record.spec of TensorStore({\n  'base': "
                "{"
            ) from inner
    except Exception as error:
        said = describe(error, step_dir)
    assert said == f"state array 'w': file '2/state/ocdbt.process_0/d/{big.name}' is truncated (100 of 10169 bytes)"


class Prompts:
    """A prompt set as the RL prompt stream sees it (lm.data.prompts.PromptSet): rows of an index."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        return {"index": np.int32(i)}


def prompt_stream():
    from lm.data.pipeline import Source, train_dataset

    return iter(train_dataset([Source("prompts.jsonl", Prompts(), 1.0)], seq_len=8, global_batch=4, seed=3, pack=False))


def test_rl_prompt_stream_position_is_checked(tmp_path, capsys):
    """lm rl keeps its prompt stream in the data item (lm.train.rl: the iterator fit checkpoints)."""
    root = tmp_path / "checkpoints"
    ckpt = Checkpointer(root, every_steps=1, keep=5)
    it = prompt_stream()
    for step in (1, 2):
        next(it)
        ckpt.save(step, tiny_state(step), it)
    ckpt.close()
    _edit_json(next((root / "2" / "data").glob("*.json")), lambda s: s.update(batches=s["batches"] + 1))
    resumed = prompt_stream()
    _, step, _ = Checkpointer(root, every_steps=1, keep=5).restore(tiny_target(), resumed)
    assert step == 1
    assert "data state '2/data/process_0-of-1.json' differs from what was saved" in capsys.readouterr().out
    reference = prompt_stream()
    next(reference)
    np.testing.assert_array_equal(next(resumed)["index"], next(reference)["index"])


def test_checkpoint_without_digests_is_restored_with_a_warning(tmp_path, capsys):
    """Checkpoints written before the meta and data digests: accepted, saying they are unchecked."""
    root = tmp_path / "checkpoints"
    ckpt = Checkpointer(root, every_steps=1, keep=5)
    it = data_iter()
    next(it)
    ckpt.save(1, tiny_state(1), it)
    ckpt.close()
    _edit_json(root / "1" / "meta" / "metadata", lambda m: [m.pop("meta_checksum"), m.pop("data_checksums")])
    resumed = data_iter()
    _, step, _ = Checkpointer(root, every_steps=1, keep=5).restore(tiny_target(), resumed)
    assert step == 1 and (root / "1").is_dir()
    out = capsys.readouterr().out
    assert "checkpoint step 1" in out and "predates the checksums of its meta and data items" in out
    reference = data_iter()
    next(reference)
    np.testing.assert_array_equal(next(resumed), next(reference))


def test_data_position_of_another_process_count_needs_row_streams(tmp_path):
    """An iterator whose state does not name its batch rows cannot take over another process's rows."""
    root = tmp_path / "checkpoints"
    ckpt = Checkpointer(root, every_steps=1, keep=5)
    ckpt.save(1, tiny_state(1), data_iter())
    ckpt.close()
    two = {"process_0-of-2.json": "0" * 64, "process_1-of-2.json": "1" * 64}
    _unseal(root / "1", lambda m: m.update(data_checksums=two))
    with pytest.raises(
        IncompatibleCheckpoint,
        match="data position of 2 process.*this run has 1, and it cannot be regrouped: this stage's data "
        "iterator does not record which batch rows it feeds",
    ):
        Checkpointer(root, every_steps=1, keep=5).restore(tiny_target(), data_iter())
    assert (root / "1").is_dir()  # a different setup, not a damaged checkpoint


def _rows_iter(rows=None):
    from lm.data.pipeline import Source, train_dataset
    from tests.data.test_grain_pipeline import make_set

    sources = [Source("a", make_set([3, 17, 6, 2, 30, 9, 5, 12]), 1.0)]
    return iter(train_dataset(sources, seq_len=8, global_batch=4, seed=3, rows=rows))


def _as_two_processes(step_dir: pathlib.Path, states: list) -> None:
    """The data item as two processes would have written it, with matching digests in the meta."""
    (step_dir / "data" / "process_0-of-1.json").unlink()
    digests = {}
    for i, state in enumerate(states):
        name = f"process_{i}-of-2.json"
        (step_dir / "data" / name).write_text(json.dumps(state))
        digests[name] = _json_digest(state)
    _unseal(step_dir, lambda m: m.update(data_checksums=digests))


def test_data_position_of_two_processes_is_regrouped_for_one(tmp_path):
    root = tmp_path / "checkpoints"
    straight = [next(it) for it in [_rows_iter()] for _ in range(6)]
    halves = [_rows_iter([0, 1]), _rows_iter([2, 3])]
    for it in halves:
        next(it), next(it)
    ckpt = Checkpointer(root, every_steps=1, keep=5)
    ckpt.save(2, tiny_state(2), _rows_iter())
    ckpt.close()
    _as_two_processes(root / "2", [it.get_state() for it in halves])
    resumed = _rows_iter()
    _, step, _ = Checkpointer(root, every_steps=1, keep=5).restore(tiny_target(), resumed)
    assert step == 2
    for want in straight[2:]:
        got = next(resumed)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    # a damaged state of one of the two is still damage, found before any regrouping
    _edit_json(root / "2" / "data" / "process_1-of-2.json", lambda s: s.update(batches=3))
    with pytest.raises(Exception, match="process_1-of-2.json' differs from what was saved"):
        Checkpointer(root, every_steps=1, keep=5).restore(tiny_target(), _rows_iter(), step=2)


def test_two_process_data_states_without_rows_are_refused_in_one_line(tmp_path):
    root = tmp_path / "checkpoints"
    ckpt = Checkpointer(root, every_steps=1, keep=5)
    ckpt.save(1, tiny_state(1), _rows_iter())
    ckpt.close()
    older = {"parents": [{"parent": {"next_index": 0}, "next_row": 1, "counter": 1}] * 2, "index": 2, "stop": False}
    _as_two_processes(root / "1", [older, older])
    with pytest.raises(IncompatibleCheckpoint, match="'process_0-of-2.json' does not record which batch rows it feeds"):
        Checkpointer(root, every_steps=1, keep=5).restore(tiny_target(), _rows_iter())
    assert (root / "1").is_dir()


def test_state_saved_on_2x2x2_continues_on_8x1x1(tmp_path):
    """The restore target carries the new mesh's shardings; one more step on each mesh agrees."""
    from lm.train.setup import host_batch

    c = config()
    c.data.seq_len = 16
    c.train.batch_size = 8
    old, new = build(c, (2, 2, 2), jax.devices()[:8]), build(c, (8, 1, 1), jax.devices()[:8])
    signature = old.signature()
    batches = [host_batch(signature, seed=i, vocab_size=64) for i in range(2)]
    step = old.train_step(signature)
    state, _ = step(old.init_state(0), old.placer(signature).from_global(batches[0]))
    ckpt = Checkpointer(tmp_path / "checkpoints", 1, keep=1, config=c)
    ckpt.save(1, state, data_iter())
    ckpt.close()
    expected, m_old = step(state, old.placer(signature).from_global(batches[1]))
    restored, _, _ = Checkpointer(tmp_path / "checkpoints", 1, keep=1, config=c).restore(new.abstract_state())
    for leaf, sharding in zip(jax.tree.leaves(restored), jax.tree.leaves(new.state_shardings)):
        assert leaf.sharding == sharding
    got, m_new = new.train_step(signature)(restored, new.placer(signature).from_global(batches[1]))
    assert float(m_new["loss"]) == pytest.approx(float(m_old["loss"]), rel=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
        jax.device_get(got.params),
        jax.device_get(expected.params),
    )


def test_garbage_in_array_data_is_caught_by_checksums(tmp_path, capsys):
    """Bytes changed inside an uncompressed chunk decode fine; only the checksum can tell."""
    root = tmp_path / "checkpoints"
    ckpt = Checkpointer(root, every_steps=1, keep=5)
    state = {"w": jax.numpy.arange(4096.0), "step": jax.numpy.int32(1)}
    for step in (1, 2):
        ckpt.save(step, state, data_iter())
    ckpt.close()
    # as if the array bytes (not the record) had changed
    _unseal(root / "2", lambda m: m["checksums"].__setitem__(1, m["checksums"][1] ^ 1))
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    want = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev), state)
    _, step, _ = Checkpointer(root, every_steps=1, keep=5).restore(want)
    assert step == 1
    assert "state array 'w' differs from what was saved (checksum" in capsys.readouterr().out


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
    with pytest.raises(UserError, match=r"step 2 .*failed: no space left on device; .*intact \(steps \[1\]\)"):
        ckpt.save(2, tiny_state(2), it)
        ckpt.wait()
    monkeypatch.undo()
    assert not (root / "2").exists()  # with keep=1, a half-written step 2 must not have evicted step 1
    restored, step, _ = Checkpointer(root, every_steps=1, keep=1).restore(tiny_target())
    assert step == 1 and float(restored["w"][0, 0]) == 1.0


def test_a_failed_async_save_is_reported_under_its_own_step(tmp_path, monkeypatch):
    """The write fails in orbax's background thread after save(2) returned; the next save (or the
    final wait) finds out, and must name step 2, not its own."""
    root = tmp_path / "checkpoints"
    ckpt = Checkpointer(root, every_steps=1, keep=5)
    it = data_iter()
    ckpt.save(1, tiny_state(1), it)
    ckpt.wait()

    from orbax.checkpoint._src.handlers import json_checkpoint_handler

    async def disk_full_later(self, x, directory):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", disk_full_later)
    ckpt.save(2, tiny_state(2), it)  # returns: the write runs in the background
    monkeypatch.undo()
    with pytest.raises(UserError) as err:
        ckpt.save(3, tiny_state(3), it)
    message = str(err.value)
    assert message.startswith(f"saving the checkpoint of step 2 in '{root}' failed: no space left on device"), message
    assert "step 3" not in message and "\n" not in message and "intact (steps [1])" in message
    assert Checkpointer(root, every_steps=1, keep=5).all_steps() == [1]


DISK_FULL = """
import sys

import grain
import jax
from orbax.checkpoint._src.handlers import json_checkpoint_handler

from lm.errors import UserError
from lm.store.checkpoint import Checkpointer


async def disk_full(self, x, directory):
    raise OSError(28, "No space left on device")


ckpt = Checkpointer(sys.argv[1], every_steps=1, keep=5)
it = iter(grain.MapDataset.range(100).batch(2).to_iter_dataset())
state = {"w": jax.numpy.zeros((64, 64))}
try:
    ckpt.save(1, state, it)
    ckpt.wait()
    json_checkpoint_handler.JsonCheckpointHandler._save_fn = disk_full
    ckpt.save(2, state, it)
    ckpt.save(3, state, it)
except UserError as e:  # as lm.cli reports it
    print(f"lm: error: {e}", file=sys.stderr)
    sys.exit(2)
"""


def test_a_failed_save_exits_with_one_line_and_no_thread_tracebacks(tmp_path):
    """orbax logs a failed background write with a traceback from each of its threads: the
    failure is said once, as one line, under the step that failed."""
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", DISK_FULL, str(tmp_path / "checkpoints")],
        env=env,
        cwd=pathlib.Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith("lm: error: saving the checkpoint of step 2 in ") and "no space left" in lines[0]


# ---- end to end: `lm train` runs ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory, corpus):
    """A tiny run straight to step 6 (checkpoints at 2, 4, 6), and a copy of it stopped at step 4."""
    from tests.e2e.test_cli_train import train

    root = tmp_path_factory.mktemp("runs")
    assert train(root / "straight", corpus, 6, "--config.checkpoint.every_steps=2", "--config.checkpoint.keep=3") == 0
    shutil.copytree(root / "straight", root / "split")
    shutil.rmtree(root / "split" / "checkpoints" / "6")
    return root


def proc_cwd() -> pathlib.Path:
    return pathlib.Path(__file__).resolve().parents[2]


def _losses(workdir) -> dict:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.slow
def test_changed_data_position_of_a_run_is_rejected_and_resume_stays_exact(tiny_runs, corpus, capsys):
    from tests.e2e.test_cli_train import final_params, train

    split = tiny_runs / "split"
    _shift_data_position(split / "checkpoints" / "4")
    capsys.readouterr()
    assert train(split, corpus, 6, "--config.checkpoint.every_steps=2", "--config.checkpoint.keep=3", "--resume") == 0
    out = capsys.readouterr().out
    assert "checkpoint step 4 is damaged (data state '4/data/process_0-of-1.json' differs from what was saved" in out
    assert "resumed from step 2" in out and (split / "rejected_checkpoints" / "4").is_dir()
    assert_trees_equal(final_params(split, 6), final_params(tiny_runs / "straight", 6))
    assert _losses(split) == _losses(tiny_runs / "straight")


@pytest.mark.slow
def test_a_resume_that_rejects_every_checkpoint_exits_with_one_line(tiny_runs, corpus, tmp_path):
    """No echo of the failed reads from orbax's threads (tracebacks, 'Event loop is closed')."""
    from tests.conftest import xla_flags
    from tests.e2e.test_cli_train import SMALL

    work = tmp_path / "w"
    shutil.copytree(tiny_runs / "straight", work)
    (work / "summary.json").unlink()  # the end-of-run work is left to do: the resume restores step 6
    for step_dir in (work / "checkpoints").iterdir():
        _cut(_largest_file(step_dir), 100)
    env = os.environ | {"XLA_FLAGS": xla_flags(8), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lm.cli",
            "train",
            "--workdir",
            str(work),
            f"--config.data.corpus={corpus}",
            "--config.train.steps=6",
            "--config.checkpoint.every_steps=2",
            "--config.checkpoint.keep=3",
            *SMALL,
            "--resume",
        ],
        env=env,
        cwd=proc_cwd(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    for noise in ("Event loop is closed", "Traceback", "never retrieved", "Exception ignored"):
        assert noise not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"lm: error: no intact checkpoint in '{work / 'checkpoints'}' (step 6: state array")
    assert "is truncated" in last and "TensorStore" not in last
    assert len(re.findall(r"step \d: state array '[^']+': file '\d/state/\S+' is truncated", last)) == 3, last
    # Nothing is set aside when no checkpoint can be restored; the advice given works from there.
    assert "nothing was moved" in last and "is damaged" not in proc.stdout
    assert saved_steps(work / "checkpoints") == [2, 4, 6] and not (work / "rejected_checkpoints").exists()
    move = re.search(r"\(mv '([^']+)' '([^']+)'\) and run the same command without --resume", last)
    assert move, last
    pathlib.Path(move.group(1)).rename(move.group(2))
    again = subprocess.run(
        [a for a in proc.args if a != "--resume"],
        env=env,
        cwd=proc_cwd(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert saved_steps(work / "checkpoints") == [2, 4, 6]


@pytest.mark.slow
def test_two_processes_check_each_others_data_position(tmp_path, corpus):
    """Each process writes its own data state; process 0 records the digests of all of them and
    every process checks every file, so all reject the same checkpoint and resume together."""
    from tests.conftest import xla_flags
    from tests.e2e.test_cli_train import SMALL
    from tests.e2e.test_distributed import free_port

    work = tmp_path / "w"
    args = SMALL + [
        "--config.train.log_every=1",
        "--config.eval.every_steps=0",
        "--config.checkpoint.every_steps=2",
        "--config.checkpoint.keep=3",
        "--config.train.sample_tokens=0",  # no closing sample: not what this test checks
        "--config.mesh.data=2",
        "--config.mesh.fsdp=4",
    ]

    def run(steps, *extra):
        port = free_port()
        env = os.environ | {"XLA_FLAGS": xla_flags(4), "JAX_PLATFORMS": "cpu"}
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "lm.cli",
                    "train",
                    "--workdir",
                    str(work),
                    f"--config.data.corpus={corpus}",
                    f"--config.train.steps={steps}",
                    *args,
                    *extra,
                    "--distributed",
                    "--coordinator",
                    f"127.0.0.1:{port}",
                    "--num-processes",
                    "2",
                    "--process-id",
                    str(i),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for i in range(2)
        ]
        outs = [p.communicate(timeout=600)[0] for p in procs]
        for p, out in zip(procs, outs):
            assert p.returncode == 0, out[-3000:]
        return outs

    run(4)
    meta = json.loads((work / "checkpoints" / "4" / "meta" / "metadata").read_text())
    assert sorted(meta["data_checksums"]) == ["process_0-of-2.json", "process_1-of-2.json"]
    first = _losses(work)
    data_1 = work / "checkpoints" / "4" / "data" / "process_1-of-2.json"
    text, n = re.subn(r'"next_index": (\d+)', lambda m: f'"next_index": {int(m.group(1)) + 1}', data_1.read_text(), 1)
    assert n == 1
    data_1.write_text(text)

    outs = run(6, "--resume")
    for out in outs:
        assert "checkpoint step 4 is damaged (data state '4/data/process_1-of-2.json' differs" in out, out[-3000:]
        assert "resumed from step 2" in out
    again = _losses(work)
    assert [again[s] for s in (3, 4)] == [first[s] for s in (3, 4)]  # the same batches as before, bitwise
    assert sorted(again) == [1, 2, 3, 4, 5, 6] and (work / "rejected_checkpoints" / "4").is_dir()
