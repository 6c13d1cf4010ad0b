"""The precomputed DPO reference file (dpo.reference=precomputed): written atomically with the
record of the pairs and the model it was computed from, checked when a resumed run reads it back,
and computed again (with a one-line warning) when it is damaged, does not fit the data, or was
computed from other pairs (even as many), another init model or other model settings.

The reference pass is stood in for by a function of the rows' tokens and the init params (a
model would give other numbers, not other logic); "fresh" values are that function run anew.
One test runs the real pass of a tiny model."""

import json
import types

import jax
import numpy as np
import pytest

from lm.config import base_config
from lm.data.preference import prepare_pairs
from lm.data.sft import SftSettings
from lm.data.tokenizer import ByteTokenizer
from lm.train import dpo

N_TRAIN, N_HELD, T = 6, 3, 96
PAIRS = [
    ("sort 312", "123", "132"),
    ("sort 90", "09", "90"),
    ("sort 5521", "1255", "1525"),
    ("sort 77", "77", "7"),
    ("sort 41", "14", "41"),
    ("sort 862", "268", "286"),
    ("sort 3", "3", "33"),
    ("sort 20", "02", "20"),
    ("sort 19", "19", "91"),
]


def write_pairs(path, pairs, swapped=False):
    rows = [{"prompt": p, "chosen": r if swapped else c, "rejected": c if swapped else r} for p, c, r in pairs]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_pairs(path, cache):
    return prepare_pairs(path, ByteTokenizer(), SftSettings(seq_len=T), cache)


@pytest.fixture
def data(tmp_path):
    """{name: (train pairs, held-out pairs)}: the pairs, and the same pairs with chosen and rejected swapped."""
    out = {}
    for name, swapped in (("pairs", False), ("swapped", True)):
        train = write_pairs(tmp_path / f"{name}_train.jsonl", PAIRS[:N_TRAIN], swapped)
        held = write_pairs(tmp_path / f"{name}_heldout.jsonl", PAIRS[N_TRAIN:], swapped)
        out[name] = (read_pairs(train, tmp_path / "cache"), read_pairs(held, tmp_path / "cache"))
    return out


@pytest.fixture
def init(tmp_path):
    """An init model on disk: what finetune.init names (the record holds its fingerprint)."""
    path = tmp_path / "init.safetensors"
    path.write_bytes(b"the init model's weights")
    return path


def ctx(workdir, data, init, resume=True, heldout=True, scale=1.0, **model):
    config = base_config()
    config.finetune.init, config.eval.batch_size = str(init), 2
    config.model.update(model)
    return types.SimpleNamespace(
        workdir=workdir,
        resume=resume,
        is_main=True,
        run=None,
        config=config,
        data=(data[0], data[1] if heldout else None),
        init=types.SimpleNamespace(params={"scale": np.float32(scale)}),
    )


def stand_in(run, base, rows, batch_size):
    """[N, 2]: minus each side's response tokens (masked target ids) summed, over 1000, times the
    init params' scale."""
    sides = [rows[i]["targets"] * rows[i]["loss_mask"] for i in range(len(rows))]
    return -np.array([s.sum(axis=-1) for s in sides], np.float32) / 1000 * base["scale"]


@pytest.fixture
def passes(monkeypatch):
    """Stands in for the reference pass over the pairs; counts how often it runs."""
    calls = []

    def reference_logps(run, base, rows, batch_size):
        calls.append(len(rows))
        return stand_in(run, base, rows, batch_size)

    monkeypatch.setattr(dpo, "reference_logps", reference_logps)
    return calls


def fresh(c):
    """The reference values of a ctx, computed anew."""
    train, held = c.data
    return stand_in(None, c.init.params, train, 2), stand_in(None, c.init.params, held, 2) if held is not None else None


def assert_values(got, want):
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_a_good_file_is_read_back_without_a_pass(tmp_path, data, init, passes, capsys):
    work = tmp_path / "w"
    first = dpo._precomputed(ctx(work, data["pairs"], init, resume=False))
    assert passes == [N_TRAIN, N_HELD]
    again = dpo._precomputed(ctx(work, data["pairs"], init))
    assert passes == [N_TRAIN, N_HELD]  # read, not computed
    assert_values(again, first)
    assert_values(again, fresh(ctx(work, data["pairs"], init)))
    assert "warning" not in capsys.readouterr().out
    assert [p.name for p in work.iterdir()] == [dpo.REF_FILE]  # no temporary file left behind


def recomputed_with_a_warning(c, passes, capsys, said: str) -> str:
    """Reads the reference back for `c`: it must be computed again, with one warning line that
    holds `said`, to the fresh values; the file written then is read back by the next resume."""
    passes.clear()
    capsys.readouterr()
    got = dpo._precomputed(c)
    assert passes == [N_TRAIN, N_HELD]
    assert_values(got, fresh(c))
    line, computing = capsys.readouterr().out.splitlines()
    assert computing.startswith("reference log-probs: one pass")
    assert line.startswith(f"lm: warning: the precomputed reference '{c.workdir / dpo.REF_FILE}' "), line
    assert said in line and line.endswith("; computing it again"), line
    passes.clear()
    assert_values(dpo._precomputed(c), fresh(c))
    assert passes == []
    return line


def test_pairs_that_changed_but_are_as_many_are_computed_again(tmp_path, data, init, passes, capsys):
    work = tmp_path / "w"
    before = dpo._precomputed(ctx(work, data["pairs"], init, resume=False))
    now = ctx(work, data["swapped"], init)
    line = recomputed_with_a_warning(now, passes, capsys, "was computed from other data (train pairs: sha256 ")
    assert "held-out pairs: sha256 " in line and "another reference model" not in line
    assert not np.array_equal(fresh(now)[0], before[0])  # the swap changed the values


def test_the_same_pairs_read_from_another_cache_entry_are_reused(tmp_path, data, init, passes):
    work = tmp_path / "w"
    dpo._precomputed(ctx(work, data["pairs"], init, resume=False))
    copied = tuple(
        read_pairs(write_pairs(tmp_path / f"copy{i}.jsonl", part), tmp_path / "other-cache")
        for i, part in enumerate((PAIRS[:N_TRAIN], PAIRS[N_TRAIN:]))
    )
    assert copied[0].path != data["pairs"][0].path
    passes.clear()
    dpo._precomputed(ctx(work, copied, init))
    assert passes == []


def test_swapped_pairs_get_the_real_reference_pass_anew(tmp_path, data, init, capsys):
    """A tiny byte-level model's reference pass: after the swap, the values a fresh pass over the
    new pairs gives."""
    built = {}

    def real(pairs, resume):
        c = ctx(
            tmp_path / "w",
            pairs,
            init,
            resume=resume,
            vocab_size=264,
            d_model=32,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            d_ff=64,
            max_seq_len=T,
        )
        c.config.data.seq_len, c.config.dpo.reference = T, "precomputed"
        if not built:
            built["run"] = run = dpo.build_dpo_run(c.config, devices=jax.devices()[:1])
            built["params"] = jax.device_get(run.init_state(seed=11).params)
        c.run, c.init.params = built["run"], built["params"]
        return c

    before = dpo._precomputed(real(data["pairs"], resume=False))
    now = real(data["swapped"], resume=True)
    got = dpo._precomputed(now)
    assert "was computed from other data (train pairs: sha256 " in capsys.readouterr().out
    want = [dpo.reference_logps(now.run, now.init.params, rows, 2) for rows in now.data]
    assert_values(got, want)
    np.testing.assert_allclose(got[0], before[0][:, ::-1], rtol=1e-5)  # the sides swapped places


def test_another_init_model_or_compute_dtype_is_computed_again(tmp_path, data, init, passes, capsys):
    work = tmp_path / "w"
    dpo._precomputed(ctx(work, data["pairs"], init, resume=False))
    init.write_bytes(b"another model's weights")
    line = recomputed_with_a_warning(
        ctx(work, data["pairs"], init, scale=2.0),
        passes,
        capsys,
        "was computed from another reference model (finetune.init: ",
    )
    assert "other data" not in line
    recomputed_with_a_warning(
        ctx(work, data["pairs"], init, scale=2.0, compute_dtype="bfloat16"),
        passes,
        capsys,
        "model.compute_dtype: 'float32' (file) vs 'bfloat16' (now)",
    )
    # adapters and remat do not change the reference (the plain init model): reused
    passes.clear()
    dpo._precomputed(ctx(work, data["pairs"], init, scale=2.0, compute_dtype="bfloat16", lora_rank=4, remat="full"))
    assert passes == []


def test_a_model_setting_the_file_does_not_know_keeps_it(tmp_path, data, init, passes):
    """A setting added to the code since the file was written: its default is what the file was made with."""
    work = tmp_path / "w"
    train, held = dpo._precomputed(ctx(work, data["pairs"], init, resume=False))
    record = json.loads(str(np.load(work / dpo.REF_FILE)[dpo.RECORD]))
    del record["model"]["model.rope_truncate"]
    dpo.write_reference(work / dpo.REF_FILE, train, held, record)
    passes.clear()
    dpo._precomputed(ctx(work, data["pairs"], init))
    assert passes == []


@pytest.mark.parametrize("older", ["other pairs", "another init model"])
def test_well_formed_values_recorded_for_another_computation_are_computed_again(
    tmp_path, data, init, passes, capsys, older
):
    """A whole file with the record of an older computation but values of its own."""
    work, other = tmp_path / "w", tmp_path / "other.safetensors"
    other.write_bytes(b"another model's weights")
    then = (
        ctx(work, data["swapped"], init, resume=False)
        if older == "other pairs"
        else ctx(work, data["pairs"], other, resume=False)
    )
    dpo._precomputed(then)
    record = json.loads(str(np.load(work / dpo.REF_FILE)[dpo.RECORD]))
    rng = np.random.default_rng(0)
    dpo.write_reference(
        work / dpo.REF_FILE, -rng.random((N_TRAIN, 2), np.float32), -rng.random((N_HELD, 2), np.float32), record
    )
    said = "other data (" if older == "other pairs" else "another reference model (finetune.init: "
    recomputed_with_a_warning(ctx(work, data["pairs"], init), passes, capsys, f"was computed from {said}")


def test_a_file_without_its_record_is_computed_again(tmp_path, data, init, passes, capsys):
    work = tmp_path / "w"
    c = ctx(work, data["pairs"], init)
    work.mkdir()
    train, held = fresh(c)
    np.savez(work / dpo.REF_FILE, train=train * 2, heldout=held * 2)  # as written before the record existed
    recomputed_with_a_warning(
        c, passes, capsys, "records no fingerprint of the data and model it was computed from (an older file)"
    )


def _truncate(path, record):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _save(**arrays):
    return lambda path, record: np.savez(path, **arrays, record=np.array(json.dumps(record)))


DAMAGE = {
    "truncated": (_truncate, "unreadable: BadZipFile"),
    "garbage": (lambda p, r: p.write_bytes(b"not an npz file at all"), "unreadable"),
    "wrong_shapes": (
        _save(train=np.zeros((N_TRAIN + 1, 2), np.float32), heldout=np.zeros((N_HELD, 2), np.float32)),
        f"'train' has shape [{N_TRAIN + 1}, 2], the data need [{N_TRAIN}, 2]",
    ),
    "heldout_missing": (_save(train=np.zeros((N_TRAIN, 2), np.float32)), "no 'heldout' array"),
    "not_finite": (
        _save(train=np.full((N_TRAIN, 2), np.nan, np.float32), heldout=np.zeros((N_HELD, 2), np.float32)),
        "'train' holds non-finite values",
    ),
    "integers": (
        _save(train=np.zeros((N_TRAIN, 2), np.int32), heldout=np.zeros((N_HELD, 2), np.int32)),
        "'train' has dtype int32, not float",
    ),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_damaged_file_is_computed_again_with_a_warning(tmp_path, data, init, passes, capsys, kind):
    work = tmp_path / "w"
    dpo._precomputed(ctx(work, data["pairs"], init, resume=False))
    record = json.loads(str(np.load(work / dpo.REF_FILE)[dpo.RECORD]))
    damage, said = DAMAGE[kind]
    damage(work / dpo.REF_FILE, record)
    line = recomputed_with_a_warning(ctx(work, data["pairs"], init), passes, capsys, said)
    assert " is damaged or does not fit the data (" in line


def test_a_run_without_heldout_pairs_needs_no_heldout_array(tmp_path, data, init, passes):
    work = tmp_path / "w"
    dpo._precomputed(ctx(work, data["pairs"], init, resume=False, heldout=False))
    passes.clear()
    train, held = dpo._precomputed(ctx(work, data["pairs"], init, heldout=False))
    assert passes == [] and held is None
    np.testing.assert_array_equal(train, fresh(ctx(work, data["pairs"], init))[0])


def test_a_failed_write_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    path = tmp_path / dpo.REF_FILE
    dpo.write_reference(path, np.zeros((N_TRAIN, 2), np.float32), None, {"data": {}, "model": {}})
    before = path.read_bytes()

    def disk_full(f, **arrays):
        f.write(b"PK\x03\x04 half a zip")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez", disk_full)
    with pytest.raises(OSError):
        dpo.write_reference(path, np.ones((N_TRAIN, 2), np.float32), None, {"data": {}, "model": {}})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [dpo.REF_FILE]
