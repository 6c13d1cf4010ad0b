"""The grain loader over in-memory shard sets whose token values are their global positions,
so every row tells exactly which document and which piece it came from."""

import json

import numpy as np
import pytest

from lm.data.pipeline import BATCH_DTYPES, Pieces, Source, eval_batches, regroup_state, train_dataset
from lm.data.shards import ShardSet
from lm.errors import UserError


def make_set(lengths, base=0, n_shards=2):
    """Documents of the given token counts (EOS included); token value = base + global position."""
    tokens = np.arange(base, base + sum(lengths), dtype=np.uint32)
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    cut = len(lengths) // n_shards or len(lengths)
    groups = [list(range(i, min(i + cut, len(lengths)))) for i in range(0, len(lengths), cut)]
    toks, offs = [], []
    for g in groups:
        start, stop = bounds[g[0]], bounds[g[-1] + 1]
        toks.append(tokens[start:stop])
        offs.append(bounds[g[0] : g[-1] + 2] - start)
    return ShardSet(None, {}, toks, offs)


def take(it, n):
    return [next(it) for _ in range(n)]


def assert_same(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def segments(row):
    """[(first input token, n predictions)] of each packed piece in a row."""
    seg = row["segment_ids"]
    return [(int(row["inputs"][seg == s][0]), int((seg == s).sum())) for s in np.unique(seg[seg > 0])]


def test_pieces_split_long_documents_exactly():
    # 4 predictions (fits a row of 4), 8 (two rows), 9 (three rows: 4 + 4 + 1)
    shards = make_set([5, 9, 10])
    p = Pieces(shards, seq_len=4)
    assert len(p) == 6
    assert p.stats() == {"docs": 3, "pieces": 6, "split_docs": 2, "truncated_docs": 0}
    expected = [
        ([0, 1, 2, 3], [1, 2, 3, 4]),
        ([5, 6, 7, 8], [6, 7, 8, 9]),
        ([9, 10, 11, 12], [10, 11, 12, 13]),
        ([14, 15, 16, 17], [15, 16, 17, 18]),
        ([18, 19, 20, 21], [19, 20, 21, 22]),
        ([22], [23]),
    ]
    for i, (inputs, targets) in enumerate(expected):
        np.testing.assert_array_equal(p[i]["inputs"], inputs)
        np.testing.assert_array_equal(p[i]["targets"], targets)


def test_packed_rows_follow_the_batch_contract():
    lengths = [3, 17, 6, 2, 30, 9, 5, 12, 4, 8, 25, 7] * 3
    shards = make_set(lengths)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    doc_of = lambda tok: int(np.searchsorted(starts, tok, side="right")) - 1  # noqa: E731
    seq = 8
    batches = take(iter(train_dataset([Source("a", shards, 1.0)], seq_len=seq, global_batch=4, seed=0)), 12)
    all_pieces = Pieces(shards, seq)
    pieces = {(int(p["inputs"][0]), len(p["inputs"])) for p in (all_pieces[i] for i in range(len(all_pieces)))}
    n_pad = 0
    for b in batches:
        want = {k: (np.dtype(d), (4, seq)) for k, d in BATCH_DTYPES.items()}
        assert {k: (v.dtype, v.shape) for k, v in b.items()} == want
        for i in range(4):
            row = {k: v[i] for k, v in b.items()}
            seg = row["segment_ids"]
            np.testing.assert_array_equal(row["loss_mask"], seg > 0)  # no loss on padding
            used = seg > 0
            assert not used[np.argmin(used) :].any() or used.all()  # padding only at the end
            n_pad += int((~used).sum())
            for s in np.unique(seg[used]):
                where = np.flatnonzero(seg == s)
                assert (np.diff(where) == 1).all()  # one contiguous span per segment
                np.testing.assert_array_equal(row["positions"][where], np.arange(len(where)))
                x, y = row["inputs"][where], row["targets"][where]
                np.testing.assert_array_equal(np.diff(x), 1)
                np.testing.assert_array_equal(y, x + 1)  # next token, same document
                assert doc_of(x[0]) == doc_of(y[-1])  # never crosses into another document
                assert (int(x[0]), len(where)) in pieces  # a whole piece: packing never cuts one
    assert n_pad > 0  # this mix of lengths does need padding


def test_epochs_cover_every_piece_once_and_reshuffle():
    # 24 documents of exactly one full row each: each row is one piece, in the stream's order.
    shards = make_set([5] * 24)
    it = iter(train_dataset([Source("a", shards, 1.0)], seq_len=4, global_batch=4, seed=3))
    firsts = [[int(r[0]) for r in b["inputs"]] for b in take(it, 12)]
    epoch1 = sorted(t for b in firsts[:6] for t in b)
    epoch2 = sorted(t for b in firsts[6:] for t in b)
    assert epoch1 == epoch2 == [5 * i for i in range(24)]
    assert firsts[:6] != firsts[6:]
    other = iter(train_dataset([Source("a", shards, 1.0)], seq_len=4, global_batch=4, seed=4))
    assert [[int(r[0]) for r in b["inputs"]] for b in take(other, 6)] != firsts[:6]


@pytest.mark.parametrize("process_count", [2, 4])
def test_processes_read_disjoint_parts_of_the_same_global_batch(process_count):
    """Rows fed by different processes, joined, are the global batch; replicas (the same rows on
    two processes) get identical data."""
    shards = make_set([3, 17, 6, 2, 30, 9, 5, 12, 4, 8, 25, 7] * 8)  # 152 pieces: 19 per stream and epoch
    kw = dict(seq_len=8, global_batch=8, seed=1)
    whole = take(iter(train_dataset([Source("a", shards, 1.0)], **kw)), 10)
    share = 8 // process_count
    parts = [
        take(iter(train_dataset([Source("a", shards, 1.0)], rows=range(p * share, (p + 1) * share), **kw)), 10)
        for p in range(process_count)
    ]
    joined = [{k: np.concatenate([p[i][k] for p in parts]) for k in whole[0]} for i in range(10)]
    assert_same(whole, joined)
    replica = take(iter(train_dataset([Source("a", shards, 1.0)], rows=range(share), **kw)), 10)
    assert_same(replica, parts[0])
    odd = take(iter(train_dataset([Source("a", shards, 1.0)], rows=[5, 2], **kw)), 3)
    assert_same(odd, [{k: v[[5, 2]] for k, v in b.items()} for b in whole[:3]])
    # Within an epoch no piece is read by two processes (two batches stay well inside the first one).
    seen = [
        {s for b in p[:2] for i in range(len(b["inputs"])) for s in segments({k: v[i] for k, v in b.items()})}
        for p in parts
    ]
    for a in range(process_count):
        for b in range(a + 1, process_count):
            assert not seen[a] & seen[b]


def test_resume_is_exact_across_epochs_with_a_mixture():
    a = make_set([3, 17, 6, 2, 30, 9, 5, 12])
    b = make_set([4, 8, 25, 7, 11], base=10**6)
    sources = [Source("a", a, 2.0), Source("b", b, 1.0)]
    kw = dict(seq_len=8, global_batch=4, seed=5)
    straight = take(iter(train_dataset(sources, **kw)), 30)  # source a has 17 pieces: several epochs
    for n in (0, 1, 7, 13):
        it = iter(train_dataset(sources, **kw))
        take(it, n)
        state = json.loads(json.dumps(it.get_state()))  # as stored in a checkpoint
        resumed = iter(train_dataset(sources, **kw))
        resumed.set_state(state)
        assert_same(take(resumed, 30 - n), straight[n:])


def test_mixture_follows_the_weights():
    a = make_set([5] * 40)
    b = make_set([5] * 40, base=10**6)
    it = iter(train_dataset([Source("a", a, 3.0), Source("b", b, 1.0)], seq_len=4, global_batch=4, seed=0))
    rows = np.concatenate([x["inputs"][:, 0] for x in take(it, 40)])
    assert (rows < 10**6).sum() == 120 and (rows >= 10**6).sum() == 40  # 3 : 1 exactly
    only_b = iter(train_dataset([Source("a", a, 0.0), Source("b", b, 1.0)], seq_len=4, global_batch=4, seed=0))
    assert all((x["inputs"] >= 10**6).all() for x in take(only_b, 5))


def test_bad_weights_name_the_source():
    s = make_set([5, 5])
    with pytest.raises(UserError, match="weight -1.0 of 'web'"):
        train_dataset([Source("web", s, -1.0)], seq_len=4, global_batch=2, seed=0)
    with pytest.raises(UserError, match="must sum to a positive number"):
        train_dataset([Source("a", s, 0.0), Source("b", s, 0.0)], seq_len=4, global_batch=2, seed=0)
    with pytest.raises(UserError, match="within a global batch of 4"):
        train_dataset([Source("a", s, 1.0)], seq_len=4, global_batch=4, seed=0, rows=[1, 4])


def test_eval_batches_fixed_and_padded():
    shards = make_set([5, 9, 10, 3])  # pieces of 4, 4, 4, 4, 4, 1, 2 predictions
    source = [Source("a", shards, 1.0)]
    batches = eval_batches(source, seq_len=4, batch_size=2, n_batches=10)
    assert_same(batches, eval_batches(source, seq_len=4, batch_size=2, n_batches=10))
    rows = np.concatenate([b["inputs"] for b in batches])
    seg = np.concatenate([b["segment_ids"] for b in batches])
    # Document order; the two short tail pieces share the last row.
    assert len(batches) == 3
    np.testing.assert_array_equal(rows[:5, 0], [0, 5, 9, 14, 18])
    np.testing.assert_array_equal(rows[5], [22, 24, 25, 0])
    np.testing.assert_array_equal(seg[5], [1, 2, 2, 0])
    assert_same(eval_batches(source, seq_len=4, batch_size=2, n_batches=1), batches[:1])
    padded = eval_batches(source, seq_len=4, batch_size=4, n_batches=10)  # 6 rows + 2 padding rows
    assert len(padded) == 2
    np.testing.assert_array_equal(padded[1]["inputs"][:2], rows[4:])
    assert not padded[1]["loss_mask"][2:].any() and not padded[1]["segment_ids"][2:].any()


def test_state_round_trips_through_an_orbax_checkpoint(tmp_path):
    import grain
    import orbax.checkpoint as ocp

    sources = [Source("a", make_set([3, 17, 6, 2, 30, 9]), 1.0), Source("b", make_set([4, 8, 25], base=10**6), 0.5)]
    kw = dict(seq_len=8, global_batch=4, seed=2)
    straight = take(iter(train_dataset(sources, **kw)), 12)
    it = iter(train_dataset(sources, **kw))
    take(it, 5)
    with ocp.CheckpointManager(tmp_path / "ckpt", item_names=("data",)) as manager:
        manager.save(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
        manager.wait_until_finished()
        resumed = iter(train_dataset(sources, **kw))
        manager.restore(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(resumed)))
    assert_same(take(resumed, 7), straight[5:])


def _hand_state(rows, positions, batches=3, global_batch=4):
    return {"rows": rows, "global_batch": global_batch, "batches": batches, "streams": [{"at": p} for p in positions]}


def test_regroup_state_reassigns_rows_from_hand_made_states():
    saved = {"process_0-of-2.json": _hand_state([0, 1], [10, 11]), "process_1-of-2.json": _hand_state([2, 3], [12, 13])}
    assert regroup_state(saved, [0, 1, 2, 3]) == _hand_state([0, 1, 2, 3], [10, 11, 12, 13])
    assert regroup_state(saved, [3, 1]) == _hand_state([3, 1], [13, 11])
    # replicas (a non-batch axis across processes) saved the same rows twice: they must agree
    replicas = saved | {"process_2-of-3.json": _hand_state([2, 3], [12, 13])}
    assert regroup_state(replicas, [2]) == _hand_state([2], [12])
    with pytest.raises(UserError, match="disagree on the position of row 3"):
        regroup_state(saved | {"process_2-of-3.json": _hand_state([3], [99])}, [3])
    with pytest.raises(UserError, match=r"rows \[2, 3\] have no saved position"):
        regroup_state({"process_0-of-2.json": saved["process_0-of-2.json"]}, [0, 1, 2, 3])
    with pytest.raises(UserError, match="batches taken"):
        regroup_state(saved | {"process_1-of-2.json": _hand_state([2, 3], [12, 13], batches=4)}, [0])
    with pytest.raises(UserError, match="'process_0-of-1.json' does not record which batch rows it feeds"):
        regroup_state({"process_0-of-1.json": {"parents": [], "index": 6, "stop": False}}, [0])


@pytest.mark.parametrize("before,after", [(2, 1), (1, 4), (4, 2)], ids=["2_to_1", "1_to_4", "4_to_2"])
def test_resume_on_another_number_of_processes_is_exact(before, after):
    sources = [
        Source("a", make_set([3, 17, 6, 2, 30, 9, 5, 12]), 2.0),
        Source("b", make_set([4, 8, 25], base=10**6), 1.0),
    ]
    kw = dict(seq_len=8, global_batch=4, seed=7)
    straight = take(iter(train_dataset(sources, **kw)), 20)
    share = 4 // before
    saved = {}
    for p in range(before):
        it = iter(train_dataset(sources, rows=range(p * share, (p + 1) * share), **kw))
        take(it, 9)
        saved[f"process_{p}-of-{before}.json"] = json.loads(json.dumps(it.get_state()))  # as stored
    share = 4 // after
    for p in range(after):
        rows = list(range(p * share, (p + 1) * share))
        resumed = iter(train_dataset(sources, rows=rows, **kw))
        resumed.set_state(regroup_state(saved, rows))
        assert_same(take(resumed, 11), [{k: v[rows] for k, v in b.items()} for b in straight[9:]])


def test_state_saved_before_rows_were_named_still_restores():
    """grain's own state (what checkpoints held before) restores on the same number of processes."""
    sources = [Source("a", make_set([3, 17, 6, 2, 30, 9]), 1.0)]
    kw = dict(seq_len=8, global_batch=4, seed=1)
    straight = take(iter(train_dataset(sources, **kw)), 8)
    it = iter(train_dataset(sources, **kw))
    take(it, 3)
    state = it.get_state()
    old = {"parents": state["streams"], "index": 3 * 4, "stop": False}
    resumed = iter(train_dataset(sources, **kw))
    resumed.set_state(json.loads(json.dumps(old)))
    assert_same(take(resumed, 5), straight[3:])
    assert resumed.get_state()["batches"] == 8
