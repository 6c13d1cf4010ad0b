"""The SFT step: the loss counts response tokens only, the update does not depend on packing or
on the micro-batch split, a prompt token is never a target, and LoRA on a (2,2,2) mesh equals
one device."""

import jax
import numpy as np
import pytest

from lm.config import base_config
from lm.data.chat import ChatTemplate
from lm.data.tokenizer import ByteTokenizer
from lm.model.lora import is_adapter
from lm.train.losses import sft_loss
from lm.train.setup import build_run

T, V = 128, 264
CHATS = [
    [{"role": "user", "content": "sort 312"}, {"role": "assistant", "content": "123"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "sort 90"},
        {"role": "assistant", "content": "09"},
    ],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
    [{"role": "user", "content": "sort 5"}, {"role": "assistant", "content": "5"}],
]


def config(rows, micro=1, lora=0):
    c = base_config()
    c.model.update(
        vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=T, lora_rank=lora
    )
    # eps=1: Adam's first step is ~ the gradient, not its sign (which float noise flips near 0)
    c.optim.update(lr=1e-2, warmup_steps=0, weight_decay=0.0, eps=1.0)
    c.train.update(batch_size=rows, micro_batches=micro, steps=10)
    c.data.seq_len = T
    return c


def examples():
    template = ChatTemplate.for_tokenizer(ByteTokenizer())
    out = []
    for chat in CHATS:
        ids, w = template.render(chat)
        out.append({"inputs": ids[:-1], "targets": ids[1:], "loss_mask": w[1:]})
    return out


def rows_of(groups):
    """Examples packed into rows: each group is one row (segment ids 1, 2, ...; padding after)."""
    ex = examples()
    batch = {k: np.zeros((len(groups), T), np.int32) for k in ("inputs", "targets", "segment_ids", "positions")}
    batch["loss_mask"] = np.zeros((len(groups), T), np.float32)
    for r, group in enumerate(groups):
        at = 0
        for s, i in enumerate(group, 1):
            n = len(ex[i]["inputs"])
            for k in ("inputs", "targets", "loss_mask"):
                batch[k][r, at : at + n] = ex[i][k]
            batch["segment_ids"][r, at : at + n] = s
            batch["positions"][r, at : at + n] = np.arange(n)
            at += n
        assert at <= T
    return batch


def one_step(c, batch, devices=None, trainable=None, base=None):
    run = build_run(c, sft_loss, devices=devices or jax.devices()[:1], trainable=trainable)
    state, frozen = run.init(seed=3, base=base)
    step = run.bind(run.train_step(run.signature(len(batch["inputs"]))), frozen)
    placer = run.placer(run.signature(len(batch["inputs"])))
    state, metrics = step(state, placer.from_global(batch))
    return jax.device_get(state.params), jax.device_get(metrics)


def test_rendered_mask_covers_only_response_tokens_and_prompt_tokens_are_never_targets():
    template = ChatTemplate.for_tokenizer(ByteTokenizer())
    a = [{"role": "user", "content": "sort 312"}, {"role": "assistant", "content": "123"}]
    b = [{"role": "user", "content": "sort 999"}, {"role": "assistant", "content": "123"}]
    (ia, wa), (ib, wb) = template.render(a), template.render(b)
    np.testing.assert_array_equal(wa, wb)
    differ = ia != ib
    assert differ.any() and not wa[differ].any()  # the changed prompt tokens carry no loss
    np.testing.assert_array_equal(ia[1:][wa[1:] > 0], ib[1:][wb[1:] > 0])  # the counted targets are equal
    assert ByteTokenizer().decode(ia[wa > 0]) == "123<|end|>"


def test_update_is_the_same_packed_or_one_example_per_row_in_micro_batches():
    packed = rows_of([[0, 1], [2, 3]])
    alone = rows_of([[0], [1], [2], [3]])
    # two rows of two packed examples in one micro-batch vs one example per row in two micro-batches
    p_packed, m_packed = one_step(config(2), packed)
    p_alone, m_alone = one_step(config(4, micro=2), alone)
    response = sum(float(e["loss_mask"].sum()) for e in examples())
    assert m_packed["tokens"] == m_alone["tokens"] == response
    np.testing.assert_allclose(m_packed["loss"], m_alone["loss"], rtol=1e-5)
    real = sum(len(e["inputs"]) for e in examples())
    np.testing.assert_allclose(m_packed["masked_fraction"], 1 - response / real, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(p_packed), jax.tree.leaves(p_alone)):
        np.testing.assert_allclose(a, b, atol=2e-6)


@pytest.mark.parametrize("shape", [(2, 2, 2)])
def test_lora_step_on_a_mesh_equals_one_device(shape):
    from lm.model.params import split_params

    c = config(8, lora=4)
    c.mesh.update(data=shape[0], fsdp=shape[1], tensor=shape[2])
    batch = rows_of([[0, 1], [2, 3], [1], [0], [3, 2], [2], [1, 0], [3]])
    base = build_run(config(8), sft_loss, devices=jax.devices()[:1]).init(seed=1)[0].params
    base = jax.device_get(base)
    one, m_one = one_step(config(8, lora=4), batch, trainable=is_adapter, base=base)
    many, m_many = one_step(c, batch, devices=jax.devices()[:8], trainable=is_adapter, base=base)
    np.testing.assert_allclose(m_one["loss"], m_many["loss"], rtol=1e-5)
    assert jax.tree.structure(one) == jax.tree.structure(many)
    assert all(is_adapter(p) for p, _ in jax.tree_util.tree_flatten_with_path(one)[0])
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(many)):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert split_params(base, is_adapter)[0] == {}
