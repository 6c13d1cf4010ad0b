"""Pipeline schedule tables: bubbles and micro-batches in flight by hand, and a replay that
checks every read of a buffer slot finds what it should (independently of the simulator)."""

import numpy as np
import pytest

from lm.model.pipeline_schedule import BACKWARD, FORWARD, IDLE, simulate

SHAPES = [(2, 2, 1), (2, 4, 1), (4, 4, 1), (4, 8, 1), (8, 32, 1), (2, 4, 2), (4, 8, 2), (4, 16, 4), (8, 16, 2)]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro,repeats", SHAPES)
def test_bubble_by_hand(kind, stages, micro, repeats):
    """Both schedules idle (S - 1) / (R M + S - 1) of the stage-units: 1F1B changes memory, not the bubble."""
    s = simulate(kind, stages, micro, repeats)
    assert s.bubble == pytest.approx((stages - 1) / (repeats * micro + stages - 1))
    assert s.units == 2 * (repeats * micro + stages - 1)


@pytest.mark.parametrize("stages,micro,repeats", SHAPES)
def test_in_flight_by_hand(stages, micro, repeats):
    """GPipe holds every chunk of every micro-batch; 1F1B holds at most S - s on stage s;
    interleaved 1F1B's warm-up holds (R + 1) S - 1 chunks on stage 0 (Megatron's count)."""
    assert simulate("gpipe", stages, micro, repeats).in_flight == micro * repeats
    s = simulate("1f1b", stages, micro, repeats)
    held = np.cumsum(s.op == FORWARD, axis=0) - np.cumsum(s.op == BACKWARD, axis=0)
    if repeats == 1:
        assert list(held.max(axis=0)) == [min(stages - k, micro) for k in range(stages)]
        assert s.in_flight == min(stages, micro)
    else:
        assert s.in_flight == min((repeats + 1) * stages - 1, micro * repeats)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro,repeats", SHAPES)
def test_tables_deliver_every_input_and_gradient(kind, stages, micro, repeats):
    """Replays the tables: messages carry labels; every forward and backward reads the input
    (and gradient) of its own (micro-batch, round), each action runs once per stage."""
    s = simulate(kind, stages, micro, repeats)
    xbuf = [[None] * s.x_slots for _ in range(stages)]
    gbuf = [[None] * s.g_slots for _ in range(stages)]
    ran = set()
    for u in range(s.units):
        sent_x, sent_g = {}, {}
        for k in range(stages):
            op, j, r = int(s.op[u, k]), int(s.mb[u, k]), int(s.rnd[u, k])
            if op == IDLE:
                continue
            assert (op, j, r, k) not in ran
            ran.add((op, j, r, k))
            slot = s.x_slot[u, k]
            if slot < 0:
                assert (k, r) == (0, 0)
            else:
                assert xbuf[k][slot] == (j, r), (u, k)
            if op == FORWARD:
                sent_x[(k + 1) % stages] = (j, r) if k < stages - 1 else (j, r + 1)
                if k == stages - 1 and r == repeats - 1:
                    gbuf[k][s.g_slot[u, k]] = (j, r)  # the loss's gradient
            else:
                assert gbuf[k][s.g_slot[u, k]] == (j, r), (u, k)
                sent_g[(k - 1) % stages] = (j, r) if k > 0 else (j, r - 1)
        for k in range(stages):
            if s.recv_x[u, k] >= 0:
                xbuf[k][s.recv_x[u, k]] = sent_x[k]
            if s.recv_g[u, k] >= 0:
                gbuf[k][s.recv_g[u, k]] = sent_g[k]
    assert len(ran) == 2 * stages * micro * repeats


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="expected a multiple of 4"):
        simulate("1f1b", 4, 6, 2)
    with pytest.raises(ValueError, match="expected one of"):
        simulate("zero-bubble", 4, 8)
