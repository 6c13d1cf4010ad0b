"""`lm demo`'s parallelism stage (lm.demo.scale): its subprocess of 8 simulated devices trains the
tiny model as 1F1B, interleaved 1F1B and with ring attention, equal to one device, and the
evidence table prints the figures."""

import pytest

from lm.demo.scale import VARIANTS, parallel_runs, scale_lines


@pytest.mark.slow
def test_the_parallel_runs_equal_one_device(tmp_path):
    figures = parallel_runs(tmp_path)
    assert set(figures["variants"]) == set(VARIANTS)
    for name, f in figures["variants"].items():
        assert f["loss_rel"] < 1e-5, name
        assert f["param_rel"] < 1e-2, name  # Adam's first steps magnify rounding: relative to the update
    lines = scale_lines(figures)
    assert lines[0].startswith("parallelism on 8 simulated CPU devices, 3 steps")
    assert len(lines) == 1 + len(VARIANTS)


def test_no_lines_when_the_stage_failed():
    assert scale_lines({}) == []
