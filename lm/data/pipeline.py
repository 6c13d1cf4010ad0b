"""From token shard sets to batches (the batch contract: inputs, targets, loss_mask, segment_ids,
positions), with grain.

A document of n+1 tokens (its EOS included) holds n next-token predictions. It is
cut into pieces of at most seq_len predictions; consecutive pieces share one token
(the last target of one is the first input of the next), so every prediction is
made exactly once. A document longer than a row is thus split, never truncated.

Training rows are built as global-batch *streams*: row r of every global batch
comes from stream r, which reads every B-th piece (B = global batch size) of each
source's per-epoch shuffle, mixes the sources by weight (grain `MapDataset.mix`)
and packs pieces first-fit into rows (grain `FirstFitPackIterDataset`): padding
where a piece does not fit, `segment_ids` so attention never crosses documents.
A process builds only the streams of the rows it feeds, so it reads only its share,
and the global batch is the same whatever the number of processes.
Everything before packing is index arithmetic, so the iterator state is a few
integers per stream and resuming reproduces the exact batches. The state names the rows its
streams feed (`{"rows", "global_batch", "batches", "streams"}`), so the states saved by one set
of processes can be regrouped for another (`regroup_state`): a run may resume on a different
number of processes and still see exactly the batches it would have seen.

A source may instead hold ready examples (e.g. `lm.data.sft.SftExamples`: random
access to {'inputs', 'targets', 'loss_mask'} of at most seq_len predictions). They
go through the same streams as pieces; packing carries their `loss_mask`, and
first-fit packing places each example whole in one row. Mixed with token shards,
the shards' pieces get a loss mask of ones.
"""

from __future__ import annotations

import dataclasses

import grain
import numpy as np

from lm.data.shards import ShardSet
from lm.errors import UserError

# The batch contract: every text batch has these [B, T] fields.
BATCH_DTYPES = {
    "inputs": np.int32,
    "targets": np.int32,
    "loss_mask": np.float32,
    "segment_ids": np.int32,
    "positions": np.int32,
}
PACK_BINS = 8  # rows each stream packs at once: more bins, less padding, longer replay on restore
# Reading a piece is a memmap slice: threads would cost more than they save, and each
# of the many streams would own a pool.
_READ = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


@dataclasses.dataclass(frozen=True)
class Source:
    name: str  # for messages and stats, e.g. the corpus spec
    shards: ShardSet  # or ready examples with a loss mask (see the module doc)
    weight: float


class Pieces:
    """Random access to the pieces of a shard set: index -> {'inputs', 'targets'}."""

    def __init__(self, shards: ShardSet, seq_len: int):
        self.shards, self.seq_len = shards, seq_len
        predictions = shards.doc_lengths() - 1
        self.per_doc = -(-predictions // seq_len)  # ceil
        self.first = np.concatenate([[0], np.cumsum(self.per_doc)])

    def __len__(self) -> int:
        return int(self.first[-1])

    def __getitem__(self, i: int) -> dict:
        d = int(np.searchsorted(self.first, i, side="right")) - 1
        start = (int(i) - int(self.first[d])) * self.seq_len
        chunk = self.shards.doc(d)[start : start + self.seq_len + 1]
        return {"inputs": chunk[:-1], "targets": chunk[1:]}

    def stats(self) -> dict:
        """Documents longer than a row are split (never truncated): how many, into how many pieces."""
        return {
            "docs": int(len(self.per_doc)),
            "pieces": len(self),
            "split_docs": int((self.per_doc > 1).sum()),
            "truncated_docs": 0,
        }


def check_weights(sources: list[Source], key: str = "data.sources") -> None:
    for s in sources:
        if not np.isfinite(s.weight) or s.weight < 0:
            raise UserError(f"{key}: weight {s.weight} of '{s.name}' must be a finite number >= 0")
    if sum(s.weight for s in sources) <= 0:
        raise UserError(f"{key}: the weights {[s.weight for s in sources]} must sum to a positive number")


def _items(sources: list[Source], seq_len: int) -> list:
    """Random access to each source's rows-to-be: a shard set's pieces, or its ready examples
    as they are (with a loss mask of ones added to pieces when the two kinds are mixed)."""
    items = []
    for s in sources:
        if not isinstance(s.shards, ShardSet):
            longest = getattr(s.shards, "seq_len", seq_len)
            if longest > seq_len:
                raise UserError(
                    f"data: source '{s.name}' holds examples of up to {longest} predictions, "
                    f"more than a row of data.seq_len={seq_len}; prepare it with the same seq_len"
                )
            items.append(grain.MapDataset.source(s.shards))
        else:
            pieces = grain.MapDataset.source(Pieces(s.shards, seq_len))
            items.append(pieces.map(_ones_mask) if _masked(sources) else pieces)
    return items


def _masked(sources: list[Source]) -> bool:
    """Whether rows carry a loss mask of their own: some source holds ready examples."""
    return not all(isinstance(s.shards, ShardSet) for s in sources)


def _ones_mask(piece: dict) -> dict:
    return piece | {"loss_mask": np.ones(len(piece["inputs"]), np.float32)}


def _mixed(parts: list, weights: list[float]):
    return parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, weights)


def _pack(ds: grain.IterDataset, seq_len: int, bins: int, masked: bool = False) -> grain.IterDataset:
    # A loss mask is packed beside the tokens, as a meta feature: no segment ids or positions of its own.
    extra = ("loss_mask",) if masked else ()
    return grain.experimental.FirstFitPackIterDataset(
        ds,
        length_struct={"inputs": seq_len, "targets": seq_len} | dict.fromkeys(extra, seq_len),
        num_packing_bins=bins,
        shuffle_bins=False,
        meta_features=extra,
    )


def to_contract(rows: dict) -> dict:
    """grain's packed fields -> the batch contract (works on one row or a batch of rows)."""
    segments = rows["inputs_segment_ids"].astype(np.int32)
    mask = (segments > 0).astype(np.float32)  # no loss on padding
    if "loss_mask" in rows:  # and none where the examples say so (prompts)
        mask = mask * rows["loss_mask"].astype(np.float32)
    return {
        "inputs": rows["inputs"].astype(np.int32),
        "targets": rows["targets"].astype(np.int32),
        "loss_mask": mask,
        "segment_ids": segments,
        "positions": rows["inputs_positions"].astype(np.int32),
    }


def _stream_seed(seed: int, source: int) -> int:
    return (seed * 1_000_003 + source) % 2**32


def train_dataset(
    sources: list[Source], *, seq_len: int, global_batch: int, seed: int, rows=None, pack: bool = True
) -> grain.IterDataset:
    """An endless stream of batches holding rows `rows` (global row indices, default all) of
    every [global_batch, seq_len] global batch, in that order (see lm.sharding.process_rows).
    pack=False: the sources hold ready rows (e.g. preference pairs, lm.data.preference), which
    are shuffled, mixed and batched as they are."""
    if seq_len < 1 or global_batch < 1:
        raise UserError(f"data: seq_len ({seq_len}) and batch size ({global_batch}) must be >= 1")
    rows = list(range(global_batch)) if rows is None else [int(r) for r in rows]
    if not rows or not all(0 <= r < global_batch for r in rows):
        raise UserError(f"data: rows {rows} must be non-empty and within a global batch of {global_batch}")
    check_weights(sources)
    sources = [s for s in sources if s.weight > 0]
    pieces = _items(sources, seq_len)
    for s, p in zip(sources, pieces):
        if len(p) == 0:
            raise UserError(f"data: source '{s.name}' has no tokens to train on")
    # Each source is shuffled afresh every epoch (repeat reseeds the shuffle).
    epochs = [p.shuffle(seed=_stream_seed(seed, i)).repeat() for i, p in enumerate(pieces)]
    streams = []
    for r in rows:
        mixed = _mixed([e[r::global_batch] for e in epochs], [s.weight for s in sources])
        stream = mixed.to_iter_dataset(_READ)
        streams.append(_pack(stream, seq_len, PACK_BINS, _masked(sources)) if pack else stream)
    # Equal weights: grain's mix takes the streams round-robin, so batch row i is stream i.
    merged = streams[0] if len(streams) == 1 else grain.IterDataset.mix(streams)
    batches = merged.batch(len(rows), drop_remainder=True)
    return _RowStreams(batches.map(to_contract) if pack else batches, rows, global_batch)


class _RowStreams(grain.IterDataset):
    """Batches of the streams of `rows`, with a state that names each row's stream position."""

    def __init__(self, parent: grain.IterDataset, rows: list[int], global_batch: int):
        super().__init__(parent)
        self.rows, self.global_batch = rows, global_batch

    def __iter__(self):
        return _RowStreamsIterator(self._parent.__iter__(), self.rows, self.global_batch)


class _RowStreamsIterator(grain.DatasetIterator):
    def __init__(self, parent, rows: list[int], global_batch: int):
        super().__init__(parent)
        self.rows, self.global_batch, self.batches = rows, global_batch, 0

    def __next__(self):
        batch = next(self._parent)
        self.batches += 1
        return batch

    def get_state(self) -> dict:
        inner = self._parent.get_state()
        streams = [inner] if len(self.rows) == 1 else inner["parents"]
        return {"rows": self.rows, "global_batch": self.global_batch, "batches": self.batches, "streams": streams}

    def set_state(self, state: dict) -> None:
        if "streams" not in state:  # saved before states named their rows: grain's own, as it is
            self._parent.set_state(state)
            self.batches = state.get("index", 0) // len(self.rows)
            return
        if list(state["rows"]) != self.rows or state["global_batch"] != self.global_batch:
            raise UserError(
                f"data: the saved position is of rows {state['rows']} of a global batch of {state['global_batch']}; "
                f"this iterator feeds rows {self.rows} of {self.global_batch} (see lm.data.pipeline.regroup_state)"
            )
        self.batches, streams = int(state["batches"]), state["streams"]
        # The mix's index counts rows taken; a whole number of batches keeps row i on stream i.
        inner = (
            streams[0]
            if len(self.rows) == 1
            else {"parents": streams, "index": self.batches * len(self.rows), "stop": False}
        )
        self._parent.set_state(inner)


def regroup_state(saved: dict, rows) -> dict:
    """The iterator state of a process feeding `rows`, from the states other processes saved
    ({name: state}, each covering its own rows): row r's stream resumes where the process that
    fed it left it. Raises UserError when a state does not name its rows (saved before states did,
    or not a train_dataset state), when the saved states disagree, or when a row is not covered."""
    positions, batches, sizes = {}, set(), set()
    for name, state in sorted(saved.items()):
        if not isinstance(state, dict) or not {"rows", "global_batch", "batches", "streams"} <= state.keys():
            raise UserError(
                f"data state '{name}' does not record which batch rows it feeds (saved by an older version, "
                "or by a stage whose data is not row streams), so it cannot be split among another number "
                "of processes"
            )
        if len(state["rows"]) != len(state["streams"]):
            raise UserError(f"data state '{name}' lists {len(state['rows'])} rows but {len(state['streams'])} streams")
        batches.add(int(state["batches"]))
        sizes.add(int(state["global_batch"]))
        for r, stream in zip(state["rows"], state["streams"]):
            if positions.setdefault(int(r), stream) != stream:  # replicas feed the same rows
                raise UserError(f"data states disagree on the position of row {r} ('{name}' and another)")
    if len(batches) > 1 or len(sizes) > 1:
        raise UserError(f"data states disagree: batches taken {sorted(batches)}, global batch {sorted(sizes)}")
    rows = [int(r) for r in rows]
    missing = sorted(set(rows) - positions.keys())
    if missing:
        raise UserError(f"data states cover rows {sorted(positions)}; rows {missing} have no saved position")
    return {
        "rows": rows,
        "global_batch": sizes.pop(),
        "batches": batches.pop(),
        "streams": [positions[r] for r in rows],
    }


def ready_batches(items, batch_size: int, limit: int = 0) -> list[dict]:
    """The first `limit` (0 = all) ready rows of `items` (e.g. held-out preference pairs) in order,
    as batches; the last is filled with all-zero rows (no segment, no loss) to a full batch."""
    n = len(items) if limit <= 0 else min(limit, len(items))
    if n == 0:
        raise UserError("data: no held-out rows to evaluate")
    rows = [items[i] for i in range(n)]
    pad = {k: np.zeros_like(v) for k, v in rows[0].items()}
    rows += [pad] * (-n % batch_size)
    return [
        {k: np.stack([r[k] for r in rows[b : b + batch_size]]) for k in pad} for b in range(0, len(rows), batch_size)
    ]


def eval_batches(sources: list[Source], *, seq_len: int, batch_size: int, n_batches: int) -> list[dict]:
    """The first n_batches * batch_size packed rows of the held-out pieces, in document order
    (sources mixed by weight): the same every time. A short last batch is filled with
    padding rows (segment_ids 0, loss_mask 0) so every batch has the same shape."""
    check_weights(sources)
    sources = [s for s in sources if s.weight > 0]
    parts = _items(sources, seq_len)
    if any(len(p) == 0 for p in parts):
        raise UserError("data: a held-out source has no tokens; use a larger heldout_fraction or corpus")
    mixed = _mixed(parts, [s.weight for s in sources]).to_iter_dataset(_READ)
    packed = iter(_pack(mixed, seq_len, batch_size, _masked(sources)))
    rows = [to_contract(row) for _, row in zip(range(n_batches * batch_size), packed)]
    pad = {k: np.zeros_like(v) for k, v in rows[0].items()}
    rows += [pad] * (-len(rows) % batch_size)
    return [
        {k: np.stack([r[k] for r in rows[b : b + batch_size]]) for k in pad} for b in range(0, len(rows), batch_size)
    ]
