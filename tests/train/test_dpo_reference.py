"""The precomputed DPO reference file (dpo.reference=precomputed): written atomically, checked
when a resumed run reads it back, and computed again (with a one-line warning) when it is
damaged or does not fit the data."""

import types

import numpy as np
import pytest

from lm.train import dpo

N_TRAIN, N_HELD = 6, 3


def ctx(workdir, resume=True, heldout=True):
    return types.SimpleNamespace(workdir=workdir, resume=resume, is_main=True, run=None,
                                 data=(list(range(N_TRAIN)), list(range(N_HELD)) if heldout else None),
                                 config=types.SimpleNamespace(eval=types.SimpleNamespace(batch_size=2)),
                                 init=types.SimpleNamespace(params=None))


@pytest.fixture
def passes(monkeypatch):
    """Stands in for the reference pass over the pairs; counts how often it runs."""
    calls = []

    def reference_logps(run, base, rows, batch_size):
        calls.append(len(rows))
        return -np.arange(2 * len(rows), dtype=np.float32).reshape(len(rows), 2) - 1.0

    monkeypatch.setattr(dpo, "reference_logps", reference_logps)
    return calls


def expected(n):
    return -np.arange(2 * n, dtype=np.float32).reshape(n, 2) - 1.0


def test_a_good_file_is_read_back_without_a_pass(tmp_path, passes, capsys):
    first = dpo._precomputed(ctx(tmp_path, resume=False))
    assert passes == [N_TRAIN, N_HELD]
    again = dpo._precomputed(ctx(tmp_path))
    assert passes == [N_TRAIN, N_HELD]  # read, not computed
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert "warning" not in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == [dpo.REF_FILE]  # no temporary file left behind


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _save(**arrays):
    return lambda path: np.savez(path, **arrays)


DAMAGE = {
    "truncated": (_truncate, "unreadable: BadZipFile"),
    "garbage": (lambda p: p.write_bytes(b"not an npz file at all"), "unreadable"),
    "wrong_shapes": (_save(train=np.zeros((N_TRAIN + 1, 2), np.float32), heldout=np.zeros((N_HELD, 2), np.float32)),
                     f"'train' has shape [{N_TRAIN + 1}, 2], the data need [{N_TRAIN}, 2]"),
    "heldout_missing": (_save(train=np.zeros((N_TRAIN, 2), np.float32)), "no 'heldout' array"),
    "not_finite": (_save(train=np.full((N_TRAIN, 2), np.nan, np.float32), heldout=np.zeros((N_HELD, 2), np.float32)),
                   "'train' holds non-finite values"),
    "integers": (_save(train=np.zeros((N_TRAIN, 2), np.int32), heldout=np.zeros((N_HELD, 2), np.int32)),
                 "'train' has dtype int32, not float"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_damaged_file_is_computed_again_with_a_warning(tmp_path, passes, capsys, kind):
    dpo._precomputed(ctx(tmp_path, resume=False))
    path = tmp_path / dpo.REF_FILE
    damage, said = DAMAGE[kind]
    damage(path)
    passes.clear()
    capsys.readouterr()
    train, held = dpo._precomputed(ctx(tmp_path))
    assert passes == [N_TRAIN, N_HELD]
    np.testing.assert_array_equal(train, expected(N_TRAIN))
    np.testing.assert_array_equal(held, expected(N_HELD))
    line, computing = capsys.readouterr().out.splitlines()
    assert computing.startswith("reference log-probs: one pass")
    assert line.startswith(f"lm: warning: the precomputed reference '{path}' is damaged") and said in line, line
    assert line.endswith("computing it again")
    # the file was rewritten whole: the next resume reads it
    passes.clear()
    dpo._precomputed(ctx(tmp_path))
    assert passes == []


def test_a_run_without_heldout_pairs_needs_no_heldout_array(tmp_path, passes):
    dpo._precomputed(ctx(tmp_path, resume=False, heldout=False))
    passes.clear()
    train, held = dpo._precomputed(ctx(tmp_path, heldout=False))
    assert passes == [] and held is None
    np.testing.assert_array_equal(train, expected(N_TRAIN))


def test_a_failed_write_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    path = tmp_path / dpo.REF_FILE
    dpo.write_reference(path, expected(N_TRAIN), None)
    before = path.read_bytes()

    def disk_full(f, **arrays):
        f.write(b"PK\x03\x04 half a zip")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez", disk_full)
    with pytest.raises(OSError):
        dpo.write_reference(path, expected(N_TRAIN) * 2, None)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [dpo.REF_FILE]
