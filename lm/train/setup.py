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
import numpy as np
import optax
from jax.sharding import Mesh

from lm.config import rules_table
from lm.data.pipeline import BATCH_DTYPES
from lm.errors import UserError
from lm.model.build import Built, ModelFn, build_model
from lm.model.params import split_params, subtree
from lm.model.quant import base_shardings as quantized_base_shardings
from lm.model.quant import quantize_base
from lm.model.spec import ModelSpec
from lm.model.transformer import Transformer
from lm.sharding import BatchPlacer, batch_shardings, place_leaf, split_count
from lm.train import state as train_state
from lm.train.losses import pretrain_loss
from lm.train.optim import make_optimizer
from lm.train.steps import make_eval_step, make_train_step

LossFactory = Callable[[nn.Module], Callable]  # model -> LossFn (lm.train.losses)


@dataclasses.dataclass(frozen=True)
class FrozenSlot:
    """A model a run holds beside the one it trains, by name ("reference", "teacher", ...): its
    own spec and module on the run's mesh, no gradients, no optimizer state, never in a
    checkpoint; its params are supplied on every start (lm.train.steps passes them to the loss
    as lm.model.build.FrozenModel). shares_base: its params are the trained model's frozen base
    itself (a LoRA policy's reference is its base with the adapters off: no copy)."""

    built: Built
    dtype: str | None = None  # cast floating params on placement (None: as given)
    shares_base: bool = False


@dataclasses.dataclass(frozen=True)
class Run:
    """Everything a run is built from; the methods make its state, shardings and steps."""

    config: object
    built: Built  # the model on its mesh (lm.model.build)
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule
    state_shardings: train_state.TrainState
    loss_fn: Callable
    trainable: Callable | None = None  # params-tree path -> trained? (None: all; see lm.train.state)
    base_shardings: dict | None = None  # the params that do not train (the LoRA base), when trainable is set
    frozen: dict = dataclasses.field(default_factory=dict)  # {name: FrozenSlot}: models beside the trained one
    updates_per_step: int = 1  # optimizer updates per loop step (RL: epochs x minibatches per rollout batch)

    @property
    def mesh(self) -> Mesh:
        return self.built.mesh

    @property
    def rules(self) -> tuple:
        return self.built.rules

    @property
    def spec(self) -> ModelSpec:
        return self.built.spec

    @property
    def model(self) -> nn.Module:
        return self.built.module

    # ---- state -----------------------------------------------------------------------------

    def init(self, seed: int | None = None, base: dict | None = None, sources: dict | None = None):
        """(state, frozen), created on their devices already sharded. base: params (e.g.
        pretrained) replacing the fresh ones where present, checked against the model; the LoRA
        base and every frozen model without a source of its own come from it. sources: host
        params of other frozen models by name (a teacher)."""
        seed = self.config.train.seed if seed is None else seed
        if base is not None:
            train_state.check_base(self.model, base, "the initial params")
        quantized = self.base_quant != "none"
        given = base
        if quantized and base is not None:  # the adapters given, if any; the base is quantized below
            given = split_params(base, self.trainable)[0] or None
        state, own, _ = train_state.create_state(  # a quantized base given: no float copy of it made
            self.model,
            self.optimizer,
            self.mesh,
            self.rules,
            seed,
            self.trainable,
            given,
            base is None or not quantized,
            self.config.train.param_dtype,
        )
        if quantized:  # the given base's leaves quantized from where they are, one at a time
            frozen = own if base is None else split_params(base, self.trainable)[1]
            own = quantize_base(self.built, frozen, self.base_quant)
        return state, self._frozen(own, base, sources)

    def frozen_params(self, base: dict | None, sources: dict | None = None) -> dict | None:
        """The frozen params alone, placed sharded: what a resumed run needs beside its restored
        state (None when nothing is frozen)."""
        if self.frozen_shardings is None:
            return None
        if base is not None:
            train_state.check_base(self.model, base, "the initial params")
        own = None
        if self.trainable and self.base_quant != "none":
            own = quantize_base(self.built, split_params(base, self.trainable)[1], self.base_quant)
        elif self.trainable:
            frozen = split_params(base, self.trainable)[1]
            own = jax.tree.map(place_leaf, frozen, subtree(self.base_shardings, frozen))
        return self._frozen(own, base, sources)

    def _frozen(self, own, base, sources) -> dict | None:
        out = {"base": own} if self.trainable is not None else {}
        for name, slot in self.frozen.items():
            if slot.shares_base:
                out[name] = own
                continue
            given = (sources or {}).get(name, base)
            if given is None:
                raise UserError(f"the frozen model '{name}' needs params: give the run its --init")
            if name in (sources or {}):
                slot.built.check(given, f"the params of the frozen model '{name}'", complete=True)
            out[name] = slot.built.place(subtree(given, slot.built.param_shardings), slot.dtype)
        return out or None

    @property
    def base_quant(self) -> str:
        """How the LoRA base's layer weights are held: none | nf4 | int4 (model.lora_base_quant)."""
        return self.config.model.lora_base_quant if self.trainable is not None else "none"

    @property
    def frozen_shardings(self) -> dict | None:
        """{name: shardings} of everything the step takes frozen, or None."""
        out = {"base": self.base_shardings} if self.trainable is not None else {}
        out |= {n: (self.base_shardings if s.shares_base else s.built.param_shardings) for n, s in self.frozen.items()}
        return out or None

    @property
    def frozen_modules(self) -> dict:
        return {n: s.built.module for n, s in self.frozen.items()}

    def init_state(self, seed: int | None = None) -> train_state.TrainState:
        """A fresh state of a run that trains every param."""
        return self.init(seed)[0]

    def abstract_state(self) -> train_state.TrainState:
        """ShapeDtypeStructs with their shardings: the restore target and the AOT input."""
        return train_state.abstract_state(
            self.model, self.optimizer, self.state_shardings, self.trainable, self.config.train.param_dtype
        )

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
            raise UserError(
                f"{key}={batch_size} with {micro_batches} micro-batch(es) gives micro-batches of "
                f"{batch_size // micro_batches} rows, which must divide evenly over the {shards} "
                f"batch shards of mesh {dict(self.mesh.shape)}"
            )

    # ---- steps -----------------------------------------------------------------------------

    def train_step(self, signature: dict | None = None, loss_fn: Callable | None = None):
        """The jitted `step(state, batch) -> (state, metrics)` with the state donated
        (`step(state, batch, frozen)` when the run has frozen params: see `bind`)."""
        t = self.config.train
        self.check_batch(next(iter((signature or self.signature()).values())).shape[0], t.micro_batches)
        return make_train_step(
            loss_fn or self.loss_fn,
            self.optimizer,
            self.schedule,
            self.mesh,
            self.state_shardings,
            self.batch_shardings(signature),
            t.micro_batches,
            self.frozen_shardings,
            self.frozen_modules,
        )

    def eval_step(self, signature: dict | None = None, loss_fn: Callable | None = None):
        """The jitted `eval(params, batch[, frozen]) -> summed statistics`."""
        return make_eval_step(
            loss_fn or self.loss_fn,
            self.mesh,
            self.state_shardings.params,
            self.batch_shardings(signature),
            self.frozen_shardings,
            self.frozen_modules,
        )

    @staticmethod
    def bind(fn: Callable, frozen) -> Callable:
        """`fn(x, batch)` of a jitted step or eval that takes the frozen params as a third argument."""
        return fn if frozen is None else (lambda x, batch: fn(x, batch, frozen))


def build_run(
    config,
    loss: LossFactory | None = None,
    *,
    devices=None,
    model_fn: ModelFn = Transformer,
    spec: ModelSpec | None = None,
    trainable: Callable | None = None,
    frozen: dict | None = None,
    updates_per_step: int = 1,
) -> Run:
    """Builds a run from a validated config.

    loss: model -> LossFn (default: pretraining's next-token loss with the config's z-loss).
    devices: the devices of the mesh (default: all). model_fn: the module for a spec and its
    partitioning (default: the decoder; a stage may put another head on the trunk). spec:
    overrides the spec built from config.model. trainable: path -> bool picking the params
    that train (default: all; with LoRA, `lm.model.lora.is_adapter`); the others are frozen.
    frozen: {name: mesh -> FrozenSlot}: the models the run holds beside the trained one, built on
    its mesh (see `reference_slot`).
    updates_per_step: optimizer updates per step of train.steps; the learning rate schedule is
    over steps (warmup and decay in steps), constant within one.
    """
    built = build_model(config, devices, rules=rules_table(config), model_fn=model_fn, spec=spec)
    mesh, rules, model = built.mesh, built.rules, built.module
    optimizer, schedule = make_optimizer(config.optim, config.train.steps)
    if updates_per_step > 1:
        per_step = schedule
        schedule = lambda count: per_step(count // updates_per_step)  # noqa: E731
    shardings, base_shardings = train_state.state_shardings(model, optimizer, mesh, rules, trainable)
    if trainable is not None and config.model.lora_base_quant != "none":
        frozen_abstract = split_params(built.abstract_params(), trainable)[1]
        base_shardings = quantized_base_shardings(frozen_abstract, base_shardings, config.model.lora_base_quant)
    slots = {name: make(mesh) for name, make in (frozen or {}).items()}
    loss = loss or (lambda m: pretrain_loss(m, config.optim.z_loss))
    return Run(
        config, built, optimizer, schedule, shardings, loss(model), trainable, base_shardings, slots, updates_per_step
    )


def reference_slot(config, lora: bool):
    """The reference of DPO and RL: the init model as a plain decoder (no adapters, no scalar
    head). Without adapters a copy of the init params in the compute dtype; with adapters the
    frozen base itself."""
    spec = ModelSpec.from_config(config.model).without_lora()
    return lambda mesh: FrozenSlot(
        build_model(config, rules=rules_table(config), spec=spec, mesh=mesh),
        None if lora else config.model.compute_dtype,
        shares_base=lora,
    )


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
