"""Decoding with the KV cache equals the full forward pass; heads on the trunk; the param tree."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.model.cache import cache_shardings, decode_step, init_cache
from lm.model.transformer import Transformer
from tests.model.test_transformer import TINY, random_params

SPEC = dataclasses.replace(TINY, max_seq_len=24)  # GQA: 4 query heads over 2 kv heads
MAX_LEN = 20


@pytest.fixture(scope="module")
def model_params():
    model = Transformer(SPEC)
    return model, random_params(model, seed=3)


def full_logits(model, params, tokens):
    ids = jnp.asarray(tokens, jnp.int32)[None]
    return np.asarray(model.apply({"params": params}, ids, jnp.ones_like(ids), jnp.arange(ids.shape[1])[None])[0])


def test_cache_holds_only_kv_heads_stacked_over_layers(model_params):
    model, _ = model_params
    cache = init_cache(model, batch_size=3, max_len=MAX_LEN)
    assert cache["blocks"]["attn"]["k"].shape == (
        SPEC.n_layers,
        3,
        SPEC.attention.n_kv_heads,
        MAX_LEN,
        SPEC.attention.head_dim,
    )
    assert cache["segment_ids"].shape == (3, MAX_LEN)


def test_prefill_then_decode_equals_full_forward_for_rows_of_different_lengths(model_params):
    model, params = model_params
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, SPEC.vocab_size, n).tolist() for n in (12, 7, 9)]
    prompt_lens = [5, 2, 9]
    b, tp = len(seqs), max(prompt_lens)
    ids, seg = np.zeros((b, tp), np.int32), np.zeros((b, tp), np.int32)
    for r, (s, n) in enumerate(zip(seqs, prompt_lens)):
        ids[r, :n], seg[r, :n] = s[:n], 1
    pos = np.tile(np.arange(tp, dtype=np.int32), (b, 1))
    step = jax.jit(lambda p, c, i, s, q: decode_step(model, p, c, i, s, q))
    logits, cache = step(params, init_cache(model, b, MAX_LEN), ids, seg, pos)
    refs = [full_logits(model, params, s) for s in seqs]
    for r, n in enumerate(prompt_lens):
        np.testing.assert_allclose(logits[r, :n], refs[r][:n], atol=2e-5, rtol=2e-5)
    # decode one token per row at its own position; rows that are done feed padding (segment 0)
    cur = list(prompt_lens)
    for _ in range(7):
        live = [cur[r] < len(seqs[r]) for r in range(b)]
        tok = np.array([[seqs[r][cur[r]] if live[r] else 0] for r in range(b)], np.int32)
        logits, cache = step(
            params,
            cache,
            tok,
            np.array([[int(x)] for x in live], np.int32),
            np.array([[cur[r]] for r in range(b)], np.int32),
        )
        for r in range(b):
            if live[r]:
                np.testing.assert_allclose(logits[r, 0], refs[r][cur[r]], atol=2e-5, rtol=2e-5)
                cur[r] += 1
    assert cur == [len(s) for s in seqs]
    # a row alone gives what it gave in the batch
    alone, _ = step(params, init_cache(model, 1, MAX_LEN), ids[1:2], seg[1:2], pos[1:2])
    np.testing.assert_allclose(alone[0, :2], logits_prefix(step, params, model, ids, seg, pos)[1, :2], atol=1e-6)


def logits_prefix(step, params, model, ids, seg, pos):
    return step(params, init_cache(model, ids.shape[0], MAX_LEN), ids, seg, pos)[0]


def test_positions_past_the_cache_change_nothing(model_params):
    model, params = model_params
    ids = np.array([[3, 4, 5]], np.int32)
    _, cache = decode_step(model, params, init_cache(model, 1, 4), ids, np.ones_like(ids), np.arange(3)[None])
    _, after = decode_step(
        model, params, cache, np.array([[9, 9]], np.int32), np.ones((1, 2), np.int32), np.array([[4, 7]], np.int32)
    )
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, b)


def test_padding_writes_nothing(model_params):
    model, params = model_params
    ids = np.array([[3, 4, 5, 6]], np.int32)
    seg = np.array([[1, 1, 0, 0]], np.int32)
    _, cache = decode_step(model, params, init_cache(model, 1, 8), ids, seg, np.arange(4)[None])
    np.testing.assert_array_equal(cache["segment_ids"][0], [1, 1, 0, 0, 0, 0, 0, 0])
    assert not np.any(cache["blocks"]["attn"]["k"][:, 0, :, 2:])


def test_hidden_states_and_tied_head_give_the_logits(model_params):
    model, params = model_params
    ids = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
    args = (ids, jnp.ones_like(ids), jnp.arange(4)[None])
    hidden = model.apply({"params": params}, *args, output="hidden")
    assert hidden.shape == (1, 4, SPEC.d_model)
    logits = model.apply({"params": params}, *args)
    np.testing.assert_allclose(hidden @ params["embedding"].T, logits, atol=1e-5)


def test_scalar_head_sits_on_the_lm_trunk():
    model = Transformer(SPEC)
    with_head = Transformer(SPEC, scalar_head=True)
    ids = jnp.zeros((1, 4), jnp.int32)
    lm_tree = jax.eval_shape(lambda k: model.init(k, ids, ids, ids), jax.random.PRNGKey(0))["params"]
    head_tree = jax.eval_shape(lambda k: with_head.init(k, ids, ids, ids), jax.random.PRNGKey(0))["params"]
    assert set(head_tree) - set(lm_tree) == {"scalar_head"}
    assert jax.tree.structure({k: v for k, v in head_tree.items() if k != "scalar_head"}) == jax.tree.structure(lm_tree)
    params = random_params(model, seed=1)  # an LM's params initialise the trunk as they are
    w = jnp.linspace(-1.0, 1.0, SPEC.d_model)
    args = (jnp.asarray([[5, 6, 7]], jnp.int32), jnp.ones((1, 3), jnp.int32), jnp.arange(3)[None])
    values = with_head.apply(
        {"params": params | {"scalar_head": {"kernel": w, "bias": jnp.asarray(0.5)}}}, *args, output="scalar"
    )
    hidden = model.apply({"params": params}, *args, output="hidden")
    assert values.shape == (1, 3) and values.dtype == jnp.float32
    np.testing.assert_allclose(values, hidden @ w + 0.5, atol=1e-5)


# Pinned: checkpoints of earlier runs load only if these paths and shapes never change.
PINNED = {
    "embedding": (64, 32),
    "final_norm/scale": (32,),
    "blocks/attn/wq": (2, 32, 4, 8),
    "blocks/attn/wk": (2, 32, 2, 8),
    "blocks/attn/wv": (2, 32, 2, 8),
    "blocks/attn/wo": (2, 4, 8, 32),
    "blocks/attn_norm/scale": (2, 32),
    "blocks/mlp_norm/scale": (2, 32),
    "blocks/mlp/w_gate": (2, 32, 64),
    "blocks/mlp/w_up": (2, 32, 64),
    "blocks/mlp/w_down": (2, 64, 32),
}


def test_param_paths_are_those_of_earlier_checkpoints():
    ids = jnp.zeros((1, 4), jnp.int32)
    tree = nn.unbox(jax.eval_shape(lambda k: Transformer(SPEC).init(k, ids, ids, ids), jax.random.PRNGKey(0))["params"])
    flat = {"/".join(k.key for k in path): leaf.shape for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}
    assert flat == PINNED


def test_cache_shardings_split_batch_and_kv_heads():
    from lm.config import base_config, rules_table
    from lm.model.layers import Partitioning
    from lm.sharding import make_mesh

    c = base_config()
    mesh = make_mesh(dict(data=2, fsdp=2, tensor=2))
    model = Transformer(SPEC, Partitioning(mesh, rules_table(c)))
    sh = cache_shardings(model, 4, MAX_LEN, mesh, rules_table(c))
    assert tuple(sh["blocks"]["attn"]["k"].spec) == ("stage", ("data", "fsdp", "expert"), "tensor", None, None)
    assert tuple(sh["segment_ids"].spec) == (("data", "fsdp", "expert"), None)
    cache = init_cache(model, 4, MAX_LEN, sh)
    assert cache["blocks"]["attn"]["k"].addressable_shards[0].data.shape == (2, 1, 1, MAX_LEN, 8)
