"""Pipeline schedules as tables: what each stage does at each time unit, worked out in Python.

A schedule is each stage's ordered list of actions, forward F(j, r) or backward B(j, r) of
micro-batch j in round r (a circular or interleaved pipeline passes a micro-batch through the
stages `repeats` times; one round on one stage is one chunk of layers). `simulate` runs those
lists in time units of one chunk's forward or backward (both count one unit, as in the usual
bubble formulas): a stage runs its next action as soon as what it needs arrived in an earlier
unit, else it idles. The result gives the bubble and how many micro-batches each stage holds in
flight, by hand, and the slot tables that `lm.model.pipeline_1f1b` runs.

- "gpipe": every forward, then every backward (with repeats > 1: circular). What autodiff of
  the all-forward loop in lm.model.pipeline does; a stage holds all M micro-batches.
- "1f1b": stage s runs S - 1 - s forwards, then alternates one forward and one backward, then
  drains; it holds at most S - s micro-batches. With repeats > 1 it is interleaved 1F1B
  (Megatron's virtual stages): micro-batches go round in groups of S, and the warm-up is
  2 (S - 1 - s) + (R - 1) S chunk forwards.

Each stage keeps what arrives until it is used: the stage inputs of its in-flight micro-batches
(read by the forward, and again by the backward, which recomputes the chunk's forward) and the
gradients that came back for them. Slots in both buffers are assigned here, so their sizes are
the peaks the schedule reaches.
"""

from __future__ import annotations

import dataclasses

import numpy as np

KINDS = ("gpipe", "1f1b")
IDLE, FORWARD, BACKWARD = 0, 1, 2


def _orders(kind: str, stages: int, micro: int, repeats: int):
    """(forward order, backward order) of the (micro-batch, round) items every stage runs."""
    if repeats == 1:
        fwd = [(j, 0) for j in range(micro)]
    else:  # groups of S micro-batches, each going round all the chunks before the next group
        groups = range(micro // stages)
        fwd = [(g * stages + q, r) for g in groups for r in range(repeats) for q in range(stages)]
    if kind == "gpipe":
        return fwd, fwd[::-1]
    if repeats == 1:
        return fwd, fwd
    groups = range(micro // stages)
    bwd = [(g * stages + q, r) for g in groups for r in reversed(range(repeats)) for q in range(stages)]
    return fwd, bwd


def actions(kind: str, stages: int, micro: int, repeats: int, s: int) -> list[tuple[int, int, int]]:
    """Stage s's actions in order: (FORWARD or BACKWARD, micro-batch, round)."""
    fwd, bwd = _orders(kind, stages, micro, repeats)
    n = len(fwd)
    if kind == "gpipe":
        warm = n
    elif repeats == 1:
        warm = min(stages - 1 - s, n)
    else:
        warm = min(2 * (stages - 1 - s) + (repeats - 1) * stages, n)
    out = [(FORWARD, *fwd[i]) for i in range(warm)]
    for i in range(n - warm):
        out += [(FORWARD, *fwd[warm + i]), (BACKWARD, *bwd[i])]
    return out + [(BACKWARD, *b) for b in bwd[n - warm :]]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A simulated schedule. Tables are int32 [units, stages]:
    op (IDLE/FORWARD/BACKWARD), mb, rnd; x_slot: the input slot read (-1: the embedded
    micro-batch itself, round 0 on stage 0); g_slot: the gradient slot read by a backward, or
    written by the last chunk's forward (its loss's gradient); recv_x / recv_g: the slot where
    this unit's incoming activation (from the previous stage) or gradient (from the next stage)
    is kept, -1 for none."""

    kind: str
    stages: int
    microbatches: int
    repeats: int
    op: np.ndarray
    mb: np.ndarray
    rnd: np.ndarray
    x_slot: np.ndarray
    g_slot: np.ndarray
    recv_x: np.ndarray
    recv_g: np.ndarray
    x_slots: int  # the input buffer's size (micro-batch stage inputs)
    g_slots: int  # the gradient buffer's size

    @property
    def units(self) -> int:
        return self.op.shape[0]

    @property
    def bubble(self) -> float:
        """Share of stage-units spent idle."""
        return float(np.mean(self.op == IDLE))

    @property
    def in_flight(self) -> int:
        """Most micro-batches (chunks) any stage has run forward and not yet backward."""
        fwd = np.cumsum(self.op == FORWARD, axis=0)
        bwd = np.cumsum(self.op == BACKWARD, axis=0)
        return int((fwd - bwd).max())


class _Slots:
    """Slots of one stage's buffer: a slot read at unit v can take a new value written at the
    end of unit v."""

    def __init__(self):
        self.free_at: list[int] = []  # per slot: the unit from whose end it is free

    def take(self, unit: int, until: int) -> int:
        for i, f in enumerate(self.free_at):
            if f <= unit:
                self.free_at[i] = until
                return i
        self.free_at.append(until)
        return len(self.free_at) - 1


def simulate(kind: str, stages: int, microbatches: int, repeats: int = 1) -> Schedule:
    """The schedule's tables (module docstring). Interleaved 1F1B needs microbatches % stages == 0."""
    if kind not in KINDS:
        raise ValueError(f"pipeline schedule {kind!r}: expected one of {KINDS}")
    S, M, R = stages, microbatches, repeats
    if R > 1 and M % S:
        raise ValueError(f"{M} micro-batches in a {R}-round pipeline of {S} stages: expected a multiple of {S}")
    todo = [actions(kind, S, M, R, s) for s in range(S)]
    done: dict[tuple[int, int, int, int], int] = {}  # (op, j, r, stage) -> unit it ran
    rows: list[list[tuple[int, int, int]]] = []
    pos = [0] * S
    while any(pos[s] < len(todo[s]) for s in range(S)):
        u, row = len(rows), []
        if u > 4 * S * M * R + 4 * S:
            raise RuntimeError(f"pipeline schedule {kind} deadlocked")  # a bug, not bad input
        for s in range(S):
            act = todo[s][pos[s]] if pos[s] < len(todo[s]) else None
            if act is not None and all(done.get(d, u) < u for d in _needs(act, s, S, R)):
                row.append(act)
                done[(*act, s)] = u
                pos[s] += 1
            else:
                row.append((IDLE, 0, 0))
        rows.append(row)
    return _with_slots(kind, S, M, R, np.asarray(rows, np.int32), done)


def _needs(act, s: int, S: int, R: int) -> list[tuple[int, int, int, int]]:
    """What an action waits for: (op, j, r, stage) keys of `done`."""
    op, j, r = act
    if op == FORWARD:
        if s > 0:
            return [(FORWARD, j, r, s - 1)]
        return [(FORWARD, j, r - 1, S - 1)] if r > 0 else []
    if s < S - 1:
        return [(BACKWARD, j, r, s + 1), (FORWARD, j, r, s)]
    if r < R - 1:
        return [(BACKWARD, j, r + 1, 0), (FORWARD, j, r, s)]
    return [(FORWARD, j, r, s)]


def _with_slots(kind, S, M, R, rows, done) -> Schedule:
    """Assigns buffer slots: an input is kept from the unit it arrives (sent by the previous
    stage's forward) to its backward; a gradient from the unit it arrives (or the last chunk's
    forward makes it) to its backward."""
    units = rows.shape[0]
    op, mb, rnd = rows[..., 0], rows[..., 1], rows[..., 2]
    x_slot, g_slot, recv_x, recv_g = (np.full((units, S), -1, np.int32) for _ in range(4))
    xs, gs = [_Slots() for _ in range(S)], [_Slots() for _ in range(S)]
    x_of, g_of = {}, {}
    for u in range(units):
        for s in range(S):
            o, j, r = int(op[u, s]), int(mb[u, s]), int(rnd[u, s])
            if o == FORWARD:  # sends its output on: to the next stage, or round r + 1 on stage 0
                nxt = (s + 1, r) if s < S - 1 else (0, r + 1)
                if nxt[1] < R:
                    t = nxt[0]
                    slot = xs[t].take(u, done[(BACKWARD, j, nxt[1], t)])
                    recv_x[u, t], x_of[(j, nxt[1], t)] = slot, slot
                elif s == S - 1:  # the last chunk: its loss's gradient stays here
                    slot = gs[s].take(u, done[(BACKWARD, j, r, s)])
                    g_slot[u, s], g_of[(j, r, s)] = slot, slot
            if o == BACKWARD:  # sends its input's gradient back: to the previous stage or round
                prv = (s - 1, r) if s > 0 else (S - 1, r - 1)
                if prv[1] >= 0:
                    t = prv[0]
                    slot = gs[t].take(u, done[(BACKWARD, j, prv[1], t)])
                    recv_g[u, t], g_of[(j, prv[1], t)] = slot, slot
    for u in range(units):
        for s in range(S):
            o, j, r = int(op[u, s]), int(mb[u, s]), int(rnd[u, s])
            if o != IDLE:
                x_slot[u, s] = x_of.get((j, r, s), -1)
            if o == BACKWARD:
                g_slot[u, s] = g_of[(j, r, s)]
    return Schedule(
        kind,
        S,
        M,
        R,
        op,
        mb,
        rnd,
        x_slot,
        g_slot,
        recv_x,
        recv_g,
        max(len(b.free_at) for b in xs) or 1,
        max(len(b.free_at) for b in gs) or 1,
    )
