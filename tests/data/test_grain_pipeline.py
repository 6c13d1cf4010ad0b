import numpy as np
import pytest

from lm.data.pipeline import eval_batches, train_dataset, window_example
from lm.errors import UserError

E = 257  # EOS
NO_EOS = 10**6  # an eos_id that never occurs: window ids stay readable


def test_window_example_two_eos():
    tokens = np.array([99, 10, 11, E, 20, 21, 22, E, 30, 31, 98], dtype=np.uint16)
    ex = window_example(tokens, start=1, seq_len=8, eos_id=E)
    expected = {
        "inputs":      [10, 11, E, 20, 21, 22, E, 30],
        "targets":     [11, E, 20, 21, 22, E, 30, 31],
        "loss_mask":   [1, 1, 0, 1, 1, 1, 0, 1],
        "segment_ids": [1, 1, 1, 2, 2, 2, 2, 3],
        "positions":   [0, 1, 2, 0, 1, 2, 3, 0],
    }
    dtypes = {"inputs": np.int32, "targets": np.int32, "loss_mask": np.float32,
              "segment_ids": np.int32, "positions": np.int32}
    assert set(ex) == set(expected)
    for k, v in expected.items():
        assert ex[k].dtype == dtypes[k], k
        np.testing.assert_array_equal(ex[k], v, err_msg=k)


def test_window_example_eos_at_edges():
    ex = window_example(np.array([E, 1, 2, E]), start=0, seq_len=3, eos_id=E)
    np.testing.assert_array_equal(ex["inputs"], [E, 1, 2])
    np.testing.assert_array_equal(ex["targets"], [1, 2, E])
    np.testing.assert_array_equal(ex["loss_mask"], [0, 1, 1])
    np.testing.assert_array_equal(ex["segment_ids"], [1, 2, 2])
    np.testing.assert_array_equal(ex["positions"], [0, 0, 1])


def _take(it, n):
    return [next(it) for _ in range(n)]


def _window_ids(batches, seq_len):
    return [int(row[0]) // seq_len for b in batches for row in b["inputs"]]


def test_train_dataset_batches_and_determinism():
    tokens = (np.arange(20 * 8 + 1) % 250).astype(np.uint16)
    tokens[::13] = E
    kw = dict(seq_len=8, batch_size=4, eos_id=E)
    a = _take(iter(train_dataset(tokens, seed=0, **kw)), 7)
    b = _take(iter(train_dataset(tokens, seed=0, **kw)), 7)
    c = _take(iter(train_dataset(tokens, seed=1, **kw)), 7)
    for x, y in zip(a, b):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    assert any(not np.array_equal(x["inputs"], z["inputs"]) for x, z in zip(a, c))
    assert a[0]["inputs"].shape == (4, 8) and a[0]["inputs"].dtype == np.int32
    assert a[0]["loss_mask"].dtype == np.float32
    # Every row is exactly one of the non-overlapping windows.
    windows = {tuple(window_example(tokens, i * 8, 8, E)["inputs"]) for i in range(20)}
    assert all(tuple(row) in windows for x in a for row in x["inputs"])


def test_train_dataset_resume_exact():
    tokens = np.arange(30 * 4 + 1, dtype=np.int64)
    ds = train_dataset(tokens, seq_len=4, batch_size=3, seed=7, eos_id=NO_EOS)
    it = iter(ds)
    _take(it, 5)  # 30 windows / 3 = 10 batches per epoch
    state = it.get_state()
    rest = _take(it, 9)  # runs into the second, reshuffled epoch
    it2 = iter(train_dataset(tokens, seq_len=4, batch_size=3, seed=7, eos_id=NO_EOS))
    it2.set_state(state)
    for x, y in zip(rest, _take(it2, 9)):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


def test_epochs_reshuffled_and_complete():
    seq_len, n = 4, 12
    tokens = np.arange(n * seq_len + 1)
    it = iter(train_dataset(tokens, seq_len=seq_len, batch_size=3, seed=3, eos_id=NO_EOS))
    ids = _window_ids(_take(it, 8), seq_len)  # 2 epochs of 12 windows
    assert sorted(ids[:n]) == list(range(n)) and sorted(ids[n:]) == list(range(n))
    assert ids[:n] != ids[n:]


def test_host_sharding_disjoint_and_complete():
    seq_len, n = 4, 12
    tokens = np.arange(n * seq_len + 1)
    per_host = []
    for p in range(2):
        ds = train_dataset(tokens, seq_len=seq_len, batch_size=2, seed=5, eos_id=NO_EOS,
                           process_index=p, process_count=2)
        per_host.append(_window_ids(_take(iter(ds), 6), seq_len))  # 2 epochs of 6 each
    for epoch in range(2):
        a, b = (set(h[epoch * 6:(epoch + 1) * 6]) for h in per_host)
        assert len(a) == len(b) == 6
        assert not a & b
        assert a | b == set(range(n))


def test_train_dataset_too_short():
    with pytest.raises(UserError, match="fewer than one batch"):
        train_dataset(np.arange(20), seq_len=8, batch_size=4, seed=0, eos_id=E)


def test_eval_batches_deterministic_and_padded():
    tokens = np.arange(5 * 4 + 1)
    batches = eval_batches(tokens, seq_len=4, batch_size=2, n_batches=10, eos_id=NO_EOS)
    assert len(batches) == 3  # 5 windows -> 2 full batches + 1 padded
    inputs = np.concatenate([b["inputs"] for b in batches])
    np.testing.assert_array_equal(inputs[:5, 0], [0, 4, 8, 12, 16])
    assert batches[-1]["loss_mask"][1].sum() == 0 and batches[-1]["segment_ids"][1].sum() == 0
    assert all(b["inputs"].shape == (2, 4) for b in batches)
    again = eval_batches(tokens, seq_len=4, batch_size=2, n_batches=10, eos_id=NO_EOS)
    np.testing.assert_array_equal(inputs, np.concatenate([b["inputs"] for b in again]))
    first = eval_batches(tokens, seq_len=4, batch_size=2, n_batches=1, eos_id=NO_EOS)
    assert len(first) == 1 and first[0]["inputs"][:, 0].tolist() == [0, 4]


def test_eval_batches_too_short():
    with pytest.raises(UserError, match="has 5 tokens but one eval window needs 9"):
        eval_batches(np.arange(5), seq_len=8, batch_size=2, n_batches=1, eos_id=E)
