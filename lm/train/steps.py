"""The one update routine shared by every training flavour, and the eval step.

A step whose loss or gradients are not finite leaves params and optimizer state
unchanged (the step counter and RNG still advance) and reports `update_skipped`. The
learning rate is `schedule(state.step)`, both applied and logged (see lm.train.optim).

Batches are dicts of arrays of any rank with the batch axis first ([B, T] text fields,
[B] per-example values, ...); `batch_shardings` holds one sharding per field.

Gradient accumulation scans over micro-batches inside the jitted step, summing the
gradients of loss *sums*, then divides once by the global token count, so the
update does not depend on how the batch was split.

Delayed fp8 scaling's amax histories (lm.model.fp8) are params whose "gradient" is the step's
amaxes: accumulated by max, never scaled, clipped or seen by the optimizer, and shifted into
the history by the update (kept like the rest when the step is not finite).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from lm.model import fp8
from lm.model.build import FrozenModel
from lm.model.params import merge_trees
from lm.train.optim import apply_update
from lm.train.state import TrainState


def split_micro(x: jax.Array, n: int) -> jax.Array:
    """[B, ...] -> [n, B/n, ...] where micro-batch i holds rows i, i+n, ...

    Interleaving keeps every device's rows on that device (no resharding).
    """
    return x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)


def _tree_add(a, b):
    return jax.tree.map(jnp.add, a, b)


def _grads_add(a, b):
    """Summed gradients; an amax history's recorded amaxes by their largest."""
    return jax.tree_util.tree_map_with_path(lambda p, x, y: jnp.maximum(x, y) if fp8.is_history(p) else x + y, a, b)


def take_histories(grads, params):
    """(grads with zeros for the amax histories, {path: shifted history} to write after the update)."""
    shifted = {}

    def take(path, g, p):
        if not fp8.is_history(path):
            return g
        shifted[path] = fp8.shift_history(p, g)
        return jnp.zeros_like(g)

    return jax.tree_util.tree_map_with_path(take, grads, params), shifted


def put_histories(params, shifted: dict):
    return jax.tree_util.tree_map_with_path(lambda p, x: shifted.get(p, x), params) if shifted else params


def accumulate(loss_fn, params, batch, rng, n_micro: int, micro_shardings=None):
    """Sums (grads, stats) of loss_fn over n_micro interleaved micro-batches.

    micro_shardings: per field, the sharding of its [n_micro, B / n_micro, ...] split.
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if n_micro == 1:  # no loop: spares the accumulator buffers
        (_, stats), grads = grad_fn(params, batch, jax.random.fold_in(rng, 0))
        return grads, stats
    micro = jax.tree.map(lambda x: split_micro(x, n_micro), batch)
    if micro_shardings is not None:
        micro = jax.tree.map(jax.lax.with_sharding_constraint, micro, micro_shardings)
    first = jax.tree.map(lambda x: x[0], micro)
    _, stats_shape = jax.eval_shape(loss_fn, params, first, rng)
    init = (jax.tree.map(jnp.zeros_like, params), jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), stats_shape))

    def body(carry, xs):
        mb, i = xs
        (_, stats), grads = grad_fn(params, mb, jax.random.fold_in(rng, i))
        return (_grads_add(carry[0], grads), _tree_add(carry[1], stats)), None

    (grads, stats), _ = jax.lax.scan(body, init, (micro, jnp.arange(n_micro)))
    return grads, stats


def summarize(stats) -> dict:
    """Summed statistics -> means over the count (keys ending in _sum: per token, or per pair for
    pair losses; over `<name>_count` instead where one is given, e.g. KTO's desirable examples),
    totals per step (keys ending in _total) and the count as `tokens` unless a `tokens_total`
    says otherwise; with `input_tokens`, the share of them left out of the loss."""
    count = jnp.maximum(stats["count"], 1.0)

    def mean(name: str, total):
        own = stats.get(f"{name}_count")
        return total / (count if own is None else jnp.maximum(own, 1.0))

    out = {k[: -len("_sum")]: mean(k[: -len("_sum")], v) for k, v in stats.items() if k.endswith("_sum")}
    out |= {k[: -len("_total")]: v for k, v in stats.items() if k.endswith("_total")}
    out.setdefault("tokens", stats["count"])
    if "input_tokens" in out:
        out["masked_fraction"] = 1.0 - stats["count"] / jnp.maximum(out["input_tokens"], 1.0)
    return out


def is_finite(stats, grad_norm) -> jax.Array:
    """True when the loss statistics and the gradients hold no NaN/inf (the norm sees every grad)."""
    finite = [jnp.all(jnp.isfinite(v)) for v in jax.tree.leaves(stats)]
    return jnp.logical_and(jnp.isfinite(grad_norm), jnp.all(jnp.stack(finite)))


def keep_if_bad(ok: jax.Array, new, old):
    """`new` where the step was finite, else `old` bit for bit: a bad batch leaves no trace."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def _micro_shardings(batch_shardings):
    """[B, ...] field shardings -> the shardings of their [n, B/n, ...] micro-batch splits."""
    return jax.tree.map(lambda sh: NamedSharding(sh.mesh, PartitionSpec(None, *sh.spec)), batch_shardings)


def frozen_view(frozen: dict | None, modules: dict) -> tuple[dict | None, dict]:
    """(the trained model's frozen base or None, {name: FrozenModel} of the other frozen models)."""
    frozen = frozen or {}
    return frozen.get("base"), {n: FrozenModel(modules[n], p) for n, p in frozen.items() if n != "base"}


def make_train_step(
    loss_fn,
    optimizer,
    schedule,
    mesh,
    state_shardings,
    batch_shardings,
    n_micro: int = 1,
    frozen_shardings=None,
    frozen_modules=None,
):
    """Builds the jitted `step(state, batch) -> (state, metrics)`; the state buffer is donated.

    optimizer gives the update direction and schedule the learning rate (lm.train.optim);
    batch_shardings is a dict of NamedShardings, one per batch field. With frozen_shardings the
    step is `step(state, batch, frozen)`, frozen = {name: params}: 'base' (the params of the
    trained model that do not train, e.g. under LoRA adapters) is merged into the trained params
    and every other entry reaches the loss as a FrozenModel with its module from frozen_modules.
    Only the trained params are differentiated (no gradient is ever formed for the others).
    """
    micro_shardings = _micro_shardings(batch_shardings)

    def step(state: TrainState, batch, frozen=None):
        rng, step_rng = jax.random.split(state.rng)
        base, models = frozen_view(frozen, frozen_modules or {})
        loss = lambda p, b, r: loss_fn(merge_trees(p, base), b, models, r)  # noqa: E731
        grads, stats = accumulate(loss, state.params, batch, step_rng, n_micro, micro_shardings)
        grads, histories = take_histories(grads, state.params)
        # in each param's dtype: a bfloat16 state (train.param_dtype) keeps bfloat16 moments
        grads = jax.tree.map(lambda g, p: (g / jnp.maximum(stats["count"], 1.0)).astype(p.dtype), grads, state.params)
        grad_norm = optax.tree.norm(grads)
        lr = schedule(state.step)
        direction, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = put_histories(apply_update(state.params, direction, lr), histories)
        ok = is_finite(stats, grad_norm)
        params, opt_state = keep_if_bad(ok, (params, opt_state), (state.params, state.opt_state))
        metrics = summarize(stats) | {"grad_norm": grad_norm, "lr": lr, "update_skipped": 1.0 - ok.astype(jnp.float32)}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state, rng=rng), metrics

    rep = NamedSharding(mesh, PartitionSpec())
    in_shardings = (state_shardings, batch_shardings) + ((frozen_shardings,) if frozen_shardings is not None else ())
    return jax.jit(step, in_shardings=in_shardings, out_shardings=(state_shardings, rep), donate_argnums=0)


def make_eval_step(loss_fn, mesh, param_shardings, batch_shardings, frozen_shardings=None, frozen_modules=None):
    """Jitted `eval(params, batch[, frozen]) -> stats` returning sums, so callers can average
    exactly. The loss gets rng=None: evaluation is deterministic (no dropout)."""

    def evaluate(params, batch, frozen=None):
        base, models = frozen_view(frozen, frozen_modules or {})
        _, stats = loss_fn(merge_trees(params, base), batch, models, None)
        return stats

    rep = NamedSharding(mesh, PartitionSpec())
    in_shardings = (param_shardings, batch_shardings) + ((frozen_shardings,) if frozen_shardings is not None else ())
    return jax.jit(evaluate, in_shardings=in_shardings, out_shardings=rep)
