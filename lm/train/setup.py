"""The one set-up of a run: config + loss -> mesh, rule table, model, optimizer, sharded state,
batch shardings and the jitted steps.

Pretraining, `lm plan --compile`, the benches, the tests and every post-training stage build
their run here; a stage differs only in its loss function, its batch fields and its model.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from lm.config import rules_table
from lm.data.pipeline import BATCH_DTYPES
from lm.model.layers import ModelSpec, Partitioning
from lm.model.transformer import Transformer
from lm.sharding import BatchPlacer, batch_shardings, make_mesh, split_count
from lm.errors import UserError
from lm.train import state as train_state
from lm.train.losses import pretrain_loss
from lm.train.optim import make_optimizer
from lm.train.steps import make_eval_step, make_train_step

LossFactory = Callable[[nn.Module], Callable]  # model -> LossFn (lm.train.losses)


@dataclasses.dataclass(frozen=True)
class Run:
    """Everything a run is built from; the methods make its state, shardings and steps."""

    config: object
    mesh: Mesh
    rules: tuple
    spec: ModelSpec
    model: nn.Module
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule
    state_shardings: train_state.TrainState
    loss_fn: Callable
    trainable: Callable | None = None  # params-tree path -> trained? (None: all; see lm.train.state)
    frozen_shardings: dict | None = None
    updates_per_step: int = 1  # optimizer updates per loop step (RL: epochs x minibatches per rollout batch)

    # ---- state -----------------------------------------------------------------------------

    def init(self, seed: int | None = None, base: dict | None = None):
        """(state, frozen params or None), created on their devices already sharded. base:
        params (e.g. pretrained) replacing the fresh ones where present; checked against the model."""
        seed = self.config.train.seed if seed is None else seed
        if base is not None:
            train_state.check_base(self.model, base, "the initial params")
        state, frozen, _ = train_state.create_state(self.model, self.optimizer, self.mesh, self.rules, seed,
                                                    self.trainable, base)
        if self.has_reference:
            frozen = train_state.merge_trees(frozen or {}, {"reference": self.reference_params(base)})
        return state, frozen

    def frozen_params(self, base: dict):
        """The frozen params alone (a LoRA base, a reference model) from `base`, placed sharded:
        what a resumed run needs beside its restored state (None when nothing is frozen)."""
        if self.frozen_shardings is None:
            return None
        train_state.check_base(self.model, base, "the initial params")
        own = {k: v for k, v in self.frozen_shardings.items() if k != "reference"}
        frozen = jax.device_put(train_state.split_params(base, self.trainable)[1], own) if own else {}
        if self.has_reference:
            frozen["reference"] = self.reference_params(base)
        return frozen

    @property
    def has_reference(self) -> bool:
        return self.frozen_shardings is not None and "reference" in self.frozen_shardings

    def reference_params(self, base: dict | None):
        """A frozen copy of `base` in the compute dtype, sharded like the params: the reference model
        (the decoder alone: a head the policy adds, e.g. PPO's value head, is not part of it)."""
        if base is None:
            raise UserError("a run with a reference model needs the params it starts from (its --init)")
        dtype = jnp.dtype(self.config.model.compute_dtype)
        shardings = self.frozen_shardings["reference"]
        cast = jax.tree.map(lambda x: np.asarray(x).astype(dtype), {k: base[k] for k in shardings})
        return jax.device_put(cast, shardings)

    def init_state(self, seed: int | None = None) -> train_state.TrainState:
        """A fresh state of a run that trains every param."""
        return self.init(seed)[0]

    def abstract_state(self) -> train_state.TrainState:
        """ShapeDtypeStructs with their shardings: the restore target and the AOT input."""
        return train_state.abstract_state(self.model, self.optimizer, self.state_shardings, self.trainable)

    # ---- batches ---------------------------------------------------------------------------

    def signature(self, batch_size: int | None = None, extra: dict | None = None, pairs: bool = False) -> dict:
        """Global shapes and dtypes of a batch: the [B, T] text fields ([B, 2, T] with pairs: a
        preference pair per row) plus `extra` ({name: (per-row shape, dtype)}, e.g.
        {'ref_logps': ((2,), np.float32)})."""
        b, t = batch_size or self.config.train.batch_size, self.config.data.seq_len
        rows = (b, 2, t) if pairs else (b, t)
        fields = {k: jax.ShapeDtypeStruct(rows, dt) for k, dt in BATCH_DTYPES.items()}
        for name, (shape, dt) in (extra or {}).items():
            fields[name] = jax.ShapeDtypeStruct((b, *shape), dt)
        return fields

    def batch_shardings(self, signature: dict | None = None) -> dict:
        return batch_shardings(self.mesh, self.rules, signature or self.signature())

    def placer(self, signature: dict | None = None) -> BatchPlacer:
        """Host rows -> global arrays; `.rows` are the global rows this process feeds."""
        signature = signature or self.signature()
        rows = next(iter(signature.values())).shape[0]
        return BatchPlacer(self.batch_shardings(signature), rows)

    def check_batch(self, batch_size: int, micro_batches: int = 1, key: str = "train.batch_size") -> None:
        """Every micro-batch must split evenly over the mesh's batch shards."""
        sharding = next(iter(self.batch_shardings(self.signature(batch_size)).values()))
        shards = split_count(self.mesh, sharding.spec[0])
        if batch_size % micro_batches or (batch_size // micro_batches) % shards:
            raise UserError(f"{key}={batch_size} with {micro_batches} micro-batch(es) gives micro-batches of "
                            f"{batch_size // micro_batches} rows, which must divide evenly over the {shards} "
                            f"batch shards of mesh {dict(self.mesh.shape)}")

    # ---- steps -----------------------------------------------------------------------------

    def train_step(self, signature: dict | None = None, loss_fn: Callable | None = None):
        """The jitted `step(state, batch) -> (state, metrics)` with the state donated
        (`step(state, batch, frozen)` when the run has frozen params: see `bind`)."""
        t = self.config.train
        self.check_batch(next(iter((signature or self.signature()).values())).shape[0], t.micro_batches)
        return make_train_step(loss_fn or self.loss_fn, self.optimizer, self.schedule, self.mesh,
                               self.state_shardings, self.batch_shardings(signature), t.micro_batches,
                               self.frozen_shardings)

    def eval_step(self, signature: dict | None = None, loss_fn: Callable | None = None):
        """The jitted `eval(params, batch[, frozen]) -> summed statistics`."""
        return make_eval_step(loss_fn or self.loss_fn, self.mesh, self.state_shardings.params,
                              self.batch_shardings(signature), self.frozen_shardings)

    @staticmethod
    def bind(fn: Callable, frozen) -> Callable:
        """`fn(x, batch)` of a jitted step or eval that takes the frozen params as a third argument."""
        return fn if frozen is None else (lambda x, batch: fn(x, batch, frozen))


def build_run(config, loss: LossFactory | None = None, *, devices=None,
              model_fn: Callable[[ModelSpec, Partitioning], nn.Module] = Transformer,
              spec: ModelSpec | None = None, trainable: Callable | None = None, reference: bool = False,
              updates_per_step: int = 1) -> Run:
    """Builds a run from a validated config.

    loss: model -> LossFn (default: pretraining's next-token loss with the config's z-loss).
    devices: the devices of the mesh (default: all). model_fn: the module for a spec and its
    partitioning (default: the decoder; a stage may put another head on the trunk). spec:
    overrides the spec built from config.model. trainable: path -> bool picking the params
    that train (default: all; with LoRA, `lm.model.lora.is_adapter`); the others are frozen.
    reference: the run also holds a frozen copy of its initial params, in the compute dtype (the
    frozen params' 'reference' entry: DPO's and RL's reference model, without any 'scalar_head').
    updates_per_step: optimizer updates per step of train.steps; the learning rate schedule is
    over steps (warmup and decay in steps), constant within one.
    """
    mesh = make_mesh(config.mesh, devices)
    rules = rules_table(config)
    spec = spec or ModelSpec.from_config(config.model)
    model = model_fn(spec, Partitioning(mesh, rules))
    optimizer, schedule = make_optimizer(config.optim, config.train.steps)
    if updates_per_step > 1:
        per_step = schedule
        schedule = lambda count: per_step(count // updates_per_step)  # noqa: E731
    shardings, frozen = train_state.state_shardings(model, optimizer, mesh, rules, trainable)
    if reference:
        if trainable is not None:
            raise ValueError("a reference copy is for runs that train every param; with adapters the "
                             "frozen base is the reference")
        frozen = {"reference": {k: v for k, v in shardings.params.items() if k != "scalar_head"}}
    loss = loss or (lambda m: pretrain_loss(m, config.optim.z_loss))
    return Run(config, mesh, rules, spec, model, optimizer, schedule, shardings, loss(model), trainable, frozen,
               updates_per_step)


def host_batch(signature: dict, seed: int = 0, vocab_size: int = 256) -> dict:
    """Random host arrays of a signature: one document per row, every target counted (benches, tests)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, s in signature.items():
        if name == "segment_ids" or name == "loss_mask":
            out[name] = np.ones(s.shape, s.dtype)
        elif name == "positions":
            out[name] = np.broadcast_to(np.arange(s.shape[-1], dtype=s.dtype), s.shape).copy()
        elif name in ("inputs", "targets"):
            out[name] = rng.integers(0, vocab_size, s.shape).astype(s.dtype)
        else:
            out[name] = rng.standard_normal(s.shape).astype(s.dtype)
    return out
