"""`lm plan --fit` with the context axis: a sequence too long for any mesh without context gets
a context size (a power of two splitting the sequence, into 2 x context chunks for the ring),
a short one keeps context 1, and the printed overrides load back to the plan. Planner only: no
compile, so no libtpu needed."""

import re

import pytest

from lm.config import load_config
from lm.errors import UserError
from lm.plan.fit import MARGIN, candidates, contexts, overrides, search
from lm.plan.hardware import parse_target
from lm.plan.memory import estimate

LONG = ["data.seq_len=131072", "model.max_seq_len=131072", "train.batch_size=64"]
# the `xla` attention keeps [T, T] float32 scores per head and row: only the context axis splits them
XLA = [*LONG, "model.attention=xla"]


def fits(config, target) -> bool:
    try:
        return estimate(config, "pretrain", target.chips, chip=target.chip).total <= MARGIN * target.hbm_bytes
    except UserError:
        return False


# allgather holds [T/C, T] scores per head (lm.plan.memory.CONTEXT_SCORES), the ring query blocks of
# them (RING_BLOCK_BYTES): it fits a quarter of the chips
@pytest.mark.parametrize(("strategy", "slice_"), [("allgather", "v5p-256"), ("ring", "v5p-64")])
def test_a_long_sequence_gets_a_context_size_that_fits(strategy, slice_):
    target = parse_target(slice_)
    config = load_config("configs/llama3_8b.py", [*XLA, f"model.context_attention={strategy}"])
    found = candidates(config, "pretrain", target.chips)
    assert not any(fits(c, target) for c in found if c.mesh.context == 1)  # no mesh without context fits
    plan, est, compiled = search(config, "pretrain", target, devices=None)
    assert compiled is None and plan.mesh.context > 1
    assert plan.data.seq_len % (plan.mesh.context * (2 if strategy == "ring" else 1)) == 0
    assert est.total <= MARGIN * target.hbm_bytes
    assert est.total == estimate(plan, "pretrain", target.chips, chip=target.chip).total
    assert plan.mesh.data * plan.mesh.fsdp * plan.mesh.context * plan.mesh.tensor == target.chips


def test_a_short_sequence_keeps_context_one():
    target = parse_target("v5p-64")
    plan, est, _ = search(load_config("configs/llama3_8b.py", ["train.batch_size=64"]), "pretrain", target, None)
    assert plan.mesh.context == 1 and est.total <= MARGIN * target.hbm_bytes


def test_context_sizes_are_tried_only_after_every_setting_without_one():
    config = load_config("configs/llama3_8b.py", XLA)
    sizes = [c.mesh.context for c in candidates(config, "pretrain", 128)]
    assert sizes[0] == 1 and max(sizes) > 1
    assert sizes == sorted(sizes, key=lambda s: s != 1)  # every context-1 candidate comes first


@pytest.mark.parametrize(("strategy", "sizes"), [("allgather", [1, 2, 4, 8, 16, 32]), ("ring", [1, 2, 4, 8, 16])])
def test_context_sizes_split_the_sequence(strategy, sizes):
    # 96 tokens: 32 chunks of 3, but not the ring's 2 x 32 = 64 chunks
    config = load_config("configs/tiny.py", ["data.seq_len=96", f"model.context_attention={strategy}"])
    assert contexts(config, 64) == sizes
    assert contexts(config, 8) == [s for s in sizes if s <= 8]


def test_the_printed_overrides_load_back_to_the_plan(capsys):
    from lm.plan.report import plan_target

    target = parse_target("v5p-256")
    given = [*XLA, "train.batch_size=128"]  # the config's own mesh (fsdp 128) splits it, and does not fit
    config = load_config("configs/llama3_8b.py", given)
    assert plan_target(config, target, ("pretrain",), compile_=False, fit=True) == 0
    out = capsys.readouterr().out
    printed = re.search(r"--fit: pretrain fits with (.*)", out).group(1).split()
    plan = search(config, "pretrain", target, None)[0]
    assert printed == overrides(plan).split() and f"--config.mesh.context={plan.mesh.context}" in printed
    assert plan.mesh.context > 1
    loaded = load_config("configs/llama3_8b.py", [*given, *(p.removeprefix("--config.") for p in printed)])
    assert loaded == plan
    assert "context=" in out.split("--fit:")[1]  # the found setting's table names its context size
