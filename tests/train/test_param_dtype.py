"""train.param_dtype=bfloat16: the trained params, their gradients and Adam's moments in bfloat16
(no float32 master copy), kept so by every step and by a resume."""

import jax
import jax.numpy as jnp
import numpy as np

from lm.config import base_config
from lm.train.setup import build_run, host_batch


def config(param_dtype):
    c = base_config()
    c.model.update(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=16)
    c.data.seq_len = 16
    c.train.update(batch_size=8, steps=20, param_dtype=param_dtype)
    c.optim.update(lr=1e-2, warmup_steps=0)
    return c


def test_bfloat16_params_stay_bfloat16_and_train_like_float32_ones():
    losses = {}
    for dtype in ("float32", "bfloat16"):
        run = build_run(config(dtype), devices=jax.devices()[:1])
        state = run.init_state(seed=0)
        signature = run.signature()
        step, placer = run.train_step(signature), run.placer(signature)
        batch = placer.from_global(host_batch(signature, seed=0, vocab_size=64))  # one batch, overfitted
        losses[dtype] = []
        for _ in range(15):
            state, m = step(state, batch)
            losses[dtype].append(float(m["loss"]))
        moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]  # Adam's mu and nu
        leaves = jax.tree.leaves(state.params) + moments
        assert {x.dtype for x in leaves} == {jnp.dtype(dtype)}
        assert {x.dtype for x in jax.tree.leaves(run.abstract_state().params)} == {jnp.dtype(dtype)}
    f32, b16 = np.array(losses["float32"]), np.array(losses["bfloat16"])
    assert b16[0] == np.float32(b16[0]) and abs(b16[0] - f32[0]) < 0.02 * f32[0]  # the same start, rounded
    assert b16[-1] < 0.8 * b16[0] and f32[-1] < 0.8 * f32[0]  # both learn the batch
