"""`lm plan`'s per-device memory of each step, without compiling: what a user can check before
renting a pod, and what `lm plan --compile` puts beside the TPU compiler's figures.

The state part is exact: every param's shape and logical axes come from the model itself
(`jax.eval_shape` of its init: nothing is allocated), and the rule table says how many ways each
is split on the mesh (params and Adam's moments in float32, frozen models in the compute dtype;
a QLoRA base's layer weights at 4 bits plus their scales).
The rest is a model of what the compiler keeps alive at the peak of a step, in the step's shapes
(rows per device and micro-batch, sequence, widths split over `tensor`):

    gradients (float32; twice with gradient accumulation: the sum and one micro-batch's)
  + the residual stream saved at every layer (the scan's carry; more under lighter remat)
  + the `xla` attention path's float32 scores and its probabilities, one layer at a time
  + one layer's backward (float32 buffers as wide as the stream and the MLP)
  + the float32 logits, and the embedding's and head's gradients before they are split over fsdp
  + a compute-dtype copy of the trained params, and the update's temporaries under tensor parallelism
  - what fits in the chip's on-chip memory (only small configs)

Mixture of experts (model.n_experts > 0): the expert weights are split over the `expert` axis by
their logical names like every other param. The MLP's activations become the experts': dropless
routing (lm.model.moe.dropless) sorts the (token, expert) assignments of the whole micro-batch,
so every device runs experts_per_token copies of ALL the batch shards' tokens through the grouped
matmuls; capacity routing holds [experts / expert-axis, all rows, capacity, width] buffers and
the [rows, seq, experts, capacity] dispatch and combine tensors.

Pipeline (mesh.stage > 1, lm.model.pipeline; its parts in lm.plan.pipeline_memory): params are split
over `stage` by the "layers" rule (each stage holds its layers), so the state parts are per stage. A
layer works on one pipeline micro-batch (rows / pipeline_microbatches) at a time, and the backward
needs each layer's input (and the RoPE tables) of every iteration: (M * repeats + stages - 1)
iterations of L / (stages * repeats) layers. A 1F1B schedule (lm.model.pipeline_1f1b) keeps only the
inputs of the chunks in flight, the peak of its table (lm.model.pipeline_schedule), and the
gradients that came back for them; its backward recomputes one chunk at a time, so one chunk's
layers save their inputs; its loss runs per micro-batch, so the logits are one micro-batch's. Beside
them: float32 copies of the stage's block params in the pipeline's view (a circular schedule: the
chunk each iteration runs, kept for the backward), the micro-batches' store, and the final norm's
and head's backward and the logits over all the rows.

Context parallelism (mesh.context > 1, lm.model.ring_attention): every activation holds T / context
tokens per device (the `length` rule), so the stream, the saved residuals and the logits shrink by
the context size. Attention then runs no fused kernel: with `allgather` each device holds float32
scores and probabilities of its T / context queries against all T keys and keeps every layer's
gathered keys and values; the ring (lm.model.ring_flash) holds blocks of 512 of its queries
against one step's T / context keys.

Its coefficients were fitted to the TPU compiler's figures for the configs of
bench/plan_vs_compiler.py; the README shows that table with the errors. A program over the chip's
memory makes the compiler work harder to shrink it, so past the HBM the two part ways.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import numpy as np

from lm.config import rules_table
from lm.errors import UserError
from lm.infer.generate import generation_context
from lm.model import pipeline
from lm.model.moe import capacity
from lm.model.quant import BASE_GROUP, BASE_WEIGHTS, CONTRACTING
from lm.model.spec import ModelSpec
from lm.model.transformer import Transformer, abstract_params
from lm.plan.pipeline_memory import pipeline_of, pipeline_parts
from lm.sharding import AXES, mesh_shape
from lm.train.registry import compiled_step

ADAM_MOMENTS = 2  # float32 first and second moments per trained param
# Fitted to the TPU compiler (bench/plan_vs_compiler.py): residual streams saved per layer by remat
# policy, MLP-wide activations saved per layer without full remat, float32 buffers of the width of
# the stream + MLP live in one layer's backward, float32 logits copies, and the temporaries of the
# update when tensor parallelism splits it (in units of the trained float32 params).
SAVED_STREAMS = {"full": 1.0, "dots_saveable": 4.0, "dots_with_no_batch_dims_saveable": 4.0, "none": 6.0}
SAVED_MLP = 3.0
LAYER_WORK = 8.0
LOGIT_COPIES = 1.5
TP_UPDATE = 1.5
CODE_BYTES = 6 * 2**20
LOOP_CODE_BYTES = 32 * 2**20  # the code of a pipelined or mixture-of-experts step (its loops and routing)
# Mixture of experts, fitted like the above: float32 buffers of the experts' width and the stream's
# per assignment slot live in one layer's backward (by routing: the capacity path's einsums keep
# more), and the share of capacity routing's dispatch and combine tensors that is materialised.
EXPERT_WORK = {"dropless": 4.0, "capacity": 8.0}
DISPATCH_COPIES = 0.1
# Context parallelism, fitted to Llama-3-8B at 131072 tokens (context 8 or 16 x tensor 8, v5p): float32
# bytes per element of a device's [T/context, T] scores held in one layer's backward beside the
# compute-dtype probabilities (allgather: the scores and part of their gradient, on the safe side).
# The unsplit `xla` path: 4. The ring (lm.model.ring_flash) holds blocks of its queries against a
# step's keys, [RING_QUERY_BLOCK, T/context] per head: bytes per element of one such block, fitted to
# the same model at context 4, 8 and 16 (within 12%; the compiler keeps many block-sized buffers
# alive in the layer loop's body, ~3 when attention is compiled alone).
CONTEXT_SCORES = {"allgather": 6.0}
RING_QUERY_BLOCK = 512  # lm.model.ring_flash.QUERY_BLOCK (the planner imports no model kernel)
RING_BLOCK_BYTES = 330.0


@dataclasses.dataclass(frozen=True)
class Leaf:
    path: str
    shape: tuple
    names: tuple  # logical axis per dimension

    @property
    def name(self) -> str:
        """The param's own name: 'wq' of "['blocks']['attn']['wq']"."""
        return self.path.rsplit("'", 2)[-2]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@functools.lru_cache(maxsize=8)
def param_leaves(spec: ModelSpec) -> tuple[Leaf, ...]:
    """Every param of the model: shape and logical axes (from its init, abstractly)."""
    boxed = abstract_params(Transformer(spec))
    specs = nn.get_partition_spec(boxed)
    shapes = nn.unbox(boxed)
    out = []
    for (path, leaf), names in zip(
        jax.tree_util.tree_leaves_with_path(shapes),
        jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)),
    ):
        out.append(Leaf(jax.tree_util.keystr(path), tuple(leaf.shape), tuple(names)))
    return tuple(out)


def splits(names, rules: dict, mesh: dict) -> int:
    """How many ways the mesh splits an array with these logical axes (each mesh axis used once)."""
    used, total = set(), 1
    for name in names:
        for axis in rules.get(name) or ():
            if axis not in used:
                used.add(axis)
                total *= mesh[axis]
    return total


def leaf_bytes(leaf: Leaf, rules: dict, mesh: dict, itemsize: int) -> int:
    return -(-leaf.size * itemsize // splits(leaf.names, rules, mesh))


def frozen_bytes(leaf: Leaf, rules: dict, mesh: dict, itemsize: int, base_quant: str = "none") -> int:
    """A LoRA base's param on one device: in the compute dtype, or under QLoRA (model.lora_base_quant)
    a layer weight's 4-bit values, a uint8 scale code per group of inputs and a float32 scale per
    output channel (lm.model.quant.quantize_base)."""
    if base_quant == "none" or leaf.name not in BASE_WEIGHTS:
        return leaf_bytes(leaf, rules, mesh, itemsize)
    axis, n_k = CONTRACTING[leaf.name]
    p = len(leaf.shape) + axis
    k = math.prod(leaf.shape[p : p + n_k])
    per_weight = 0.5 + 1 / math.gcd(k, BASE_GROUP) + 4 / k
    return -(-int(leaf.size * per_weight) // splits(leaf.names, rules, mesh))


ARGUMENTS = ("params", "optimizer", "frozen base", "reference", "kv cache")  # what the step is given


@dataclasses.dataclass
class Estimate:
    parts: dict  # name -> bytes per device
    resident: dict = dataclasses.field(default_factory=dict)  # held beside the step, not read by it

    def by_kind(self) -> dict:
        """The parts as the compiler reports them: arguments, outputs (donated: none), temporaries, code."""
        args = sum(v for k, v in self.parts.items() if k in ARGUMENTS)
        code = self.parts.get("code", 0)
        return {"arguments": args, "outputs": 0, "temporaries": self.total - args - code, "code": code}

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def mesh_sizes(config, devices: int) -> dict:
    return dict(zip(AXES, mesh_shape(config.mesh, devices)))


def moments(optim, leaf: Leaf) -> int:
    """Optimizer moments per trained param: Adam's two, Muon's one momentum for its matrices."""
    muon = optim.optimizer == "muon" and leaf.name in BASE_WEIGHTS and len(leaf.shape) >= 2
    return 1 if muon else ADAM_MOMENTS


def _is_adapter(path: str) -> bool:
    return "lora_" in path


def estimate(config, step: str, devices: int, lora_rank: int = 16, chip=None) -> Estimate:
    """Per-device bytes of `step` (lm.train.registry.compiled_steps) of `config` on `devices` devices."""
    mesh = mesh_sizes(config, devices)
    rules = dict(rules_table(config))
    m = config.model
    compiled = compiled_step(step)
    lora = compiled.lora
    spec = ModelSpec.from_config(m)
    spec = spec.replace(lora=dict(rank=(m.lora_rank or lora_rank) if lora else 0))
    leaves = param_leaves(spec.replace(attention=dict(kernel="xla"), kernels="plain"))  # same params; traceable here
    compute = np.dtype(m.compute_dtype).itemsize
    if compiled.generation:
        return _decode(config, spec, leaves, rules, mesh, compute)
    trained = [x for x in leaves if _is_adapter(x.path)] if lora else leaves
    frozen = [x for x in leaves if not _is_adapter(x.path)] if lora else []
    itemsize = np.dtype(config.train.param_dtype).itemsize
    state = sum(leaf_bytes(x, rules, mesh, itemsize) for x in trained)
    parts = {
        "params": state,
        "optimizer": sum(moments(config.optim, x) * leaf_bytes(x, rules, mesh, itemsize) for x in trained),
        "grads": state * (2 if config.train.micro_batches > 1 else 1),
    }
    if frozen:
        parts["frozen base"] = sum(frozen_bytes(x, rules, mesh, compute, m.lora_base_quant) for x in frozen)
    resident = {}
    if compiled.holds_reference(config):
        reference = sum(leaf_bytes(x, rules, mesh, compute) for x in leaves if not _is_adapter(x.path))
        # a resident reference is held beside the step: its update reads the log-probs a scoring pass made
        (resident if compiled.reference == "resident" else parts)["reference"] = reference
    parts |= activations(config, step, spec, leaves, rules, mesh, compute, state)
    if chip is not None and chip.vmem_bytes:  # temporaries this small stay in the chip's VMEM
        temps = sum(v for k, v in parts.items() if k not in ARGUMENTS)
        parts["in on-chip memory"] = -min(temps, chip.vmem_bytes)
    parts["code"] = LOOP_CODE_BYTES if spec.moe.n_experts or pipeline_of(config, step, mesh) else CODE_BYTES
    return Estimate(parts, resident)


def batch_rows(config, step: str, mesh: dict, rules: dict) -> int:
    """Rows of one micro-batch on one device (a preference pair counts twice)."""
    t, compiled = config.train, compiled_step(step)
    rows = compiled.update_rows(config)
    shards = splits(("batch",), rules, mesh)
    if rows % t.micro_batches or (rows // t.micro_batches) % shards:
        raise UserError(
            f"train.batch_size={rows} ({step}) with {t.micro_batches} micro-batch(es) does not split "
            f"evenly over the {shards} batch shards of mesh {mesh}"
        )
    rows = rows // t.micro_batches // shards
    return rows * compiled.rows_per_example


def activations(config, step, spec: ModelSpec, leaves, rules, mesh, c, trained_f32: int) -> dict:
    """The activation terms (see the module doc) of one micro-batch on one device."""
    r, T = batch_rows(config, step, mesh, rules), config.data.seq_len
    d, ff, L, V = spec.d_model, spec.mlp.d_ff, spec.n_layers, spec.vocab_size
    heads = spec.attention.n_heads / splits(("act_heads",), rules, mesh)
    mlp = (spec.moe.shared_d_ff if spec.moe.n_experts else ff) / splits(("act_mlp",), rules, mesh)  # dense or shared
    vocab = V / splits(("act_vocab",), rules, mesh)
    length = T / splits(("length",), rules, mesh)
    embed = d / splits(("act_embed",), rules, mesh)
    pipe, rows, saved_layers = pipeline_of(config, step, mesh), r, L
    if pipe is not None:  # a layer works on one pipeline micro-batch; its inputs are saved every iteration
        shards = splits(("batch",), rules, mesh)
        pipeline.check(spec, pipe.stages, r * shards, shards)
        rows, saved_layers = r / pipe.microbatches, pipe.iterations * L / (pipe.stages * pipe.repeats)
        if pipe.schedule == "1f1b":  # only the chunk a backward recomputes saves its layers' inputs
            saved_layers = L / (pipe.stages * pipe.repeats)
    stream = rows * length * embed * c  # one layer's residual stream
    saved = SAVED_STREAMS.get(spec.remat, SAVED_STREAMS["none"])
    lighter = spec.remat != "full"
    parts = {"saved residuals": int(saved_layers * (saved * stream + lighter * SAVED_MLP * rows * length * mlp * c))}
    context = splits(("length",), rules, mesh)
    if context > 1 and spec.attention.context == "ring":  # lm.model.ring_flash: query blocks, no [T/C, T]
        parts["attention scores"] = int(RING_BLOCK_BYTES * rows * heads * min(RING_QUERY_BLOCK, length) * length)
    elif spec.attention.kernel in ("xla", "reference", "cudnn") or context > 1:
        f32 = CONTEXT_SCORES.get(spec.attention.context, 4.0) if context > 1 else 4.0
        parts["attention scores"] = int(rows * heads * length * T * (f32 + c))  # float32 scores, probs
        if context > 1 and spec.attention.context == "allgather":  # each layer's keys and values, whole
            kv = spec.attention.n_kv_heads / splits(("act_kv_heads",), rules, mesh)
            parts["gathered keys and values"] = int(
                (saved_layers if lighter else 1) * 2 * rows * T * kv * spec.attention.head_dim * c
            )
    elif lighter:  # blockwise keeps q, k, v and its output per layer for its backward
        parts["saved residuals"] += int(saved_layers * 4 * rows * length * heads * spec.attention.head_dim * c)
    parts["layer backward"] = int(LAYER_WORK * rows * length * (embed + mlp) * 4)
    if spec.moe.n_experts:
        parts |= experts(spec, rules, mesh, rows, T, c, saved_layers if lighter else 0)
    if pipe is not None:
        blocks = sum(leaf_bytes(x, rules, mesh, 4) for x in leaves if x.path.startswith("['blocks']"))
        side = pipeline_parts(pipe, spec, blocks, r, rows, length, embed, c)
        parts["saved residuals"] += side.pop("saved residuals", 0)
        parts |= side
    head_rows = rows if pipe is not None and pipe.schedule == "1f1b" else r  # 1F1B: one micro-batch's loss
    parts["logits"] = int(LOGIT_COPIES * head_rows * length * vocab * 4)
    # the embedding's and head's gradients before they are split over fsdp (float32)
    parts["table gradients"] = int(3 * V / splits(("vocab",), rules, mesh) * d * 4)
    f8 = sum(leaf_bytes(x, rules, mesh, 4) for x in leaves if _fp8_product(spec, x))
    if c < 4 or f8:  # an fp8 product's weight is rounded to one byte from float32, not cast to c
        parts["params in compute dtype"] = int((trained_f32 - f8) * c / 4 * (c < 4) + f8 / 4)
    if mesh["tensor"] > 1:
        parts["tensor-parallel update"] = int(TP_UPDATE * trained_f32)
    return parts


def _fp8_product(spec: ModelSpec, leaf: Leaf) -> bool:
    """Whether `leaf` is a trained weight of a block's fp8 product (lm.model.fp8: not routed experts)."""
    fp8 = spec.fp8 and not spec.lora.rank and "expert" not in leaf.names
    return fp8 and leaf.path.startswith("['blocks']") and leaf.name in BASE_WEIGHTS  # the blocks' products


def expert_slots(spec: ModelSpec, rules, mesh, rows: float, seq: int) -> float:
    """Assignment slots one device runs through its experts in one layer (see the module doc)."""
    shards = splits(("batch",), rules, mesh)
    if spec.moe.capacity_factor > 0:  # its experts' slots for every row of the batch
        return spec.moe.n_experts / splits(("act_expert",), rules, mesh) * rows * shards * capacity(spec, seq)
    return spec.moe.experts_per_token * rows * shards * seq  # every token of the batch, sorted by expert


def experts(spec: ModelSpec, rules, mesh, rows: float, seq: int, c: int, saved_layers: float) -> dict:
    """A mixture-of-experts layer's activations on one device: the experts' float32 work in one
    layer's backward, their saved activations under lighter remat, capacity routing's tensors."""
    width = spec.moe.expert_d_ff / splits(("expert_mlp",), rules, mesh)
    slots = expert_slots(spec, rules, mesh, rows, seq)
    embed = spec.d_model / splits(("act_embed",), rules, mesh)
    work = EXPERT_WORK["capacity" if spec.moe.capacity_factor > 0 else "dropless"]
    parts = {"expert work": int(work * slots * (width + embed) * 4)}
    if saved_layers:
        parts["saved expert activations"] = int(saved_layers * SAVED_MLP * slots * width * c)
    if spec.moe.capacity_factor > 0:  # combine (float32) and dispatch [rows, seq, experts, capacity]
        parts["routing"] = int(DISPATCH_COPIES * rows * seq * spec.moe.n_experts * capacity(spec, seq) * (4 + c))
    return parts


def _decode(config, spec, leaves, rules, mesh, c) -> Estimate:
    """The generation engine's decode block (lm.infer.engine): params in the compute dtype; the
    paged KV pool, eval.batch_size slots (rounded up to the batch shards) each holding a whole
    generation context, replicated over the batch axes and split over kv heads; the pool the block
    writes anew; one layer's weights gathered over fsdp; the logits of this device's rows."""
    from lm.infer.engine.engine import EngineConfig

    batch = splits(("batch",), rules, mesh)
    rows = -(-config.eval.batch_size // batch)
    page = EngineConfig().page_size
    tokens = rows * batch * -(-generation_context(spec) // page) * page
    kv = spec.attention.n_kv_heads / splits(("kv_heads",), rules, mesh)
    cache = int(2 * spec.n_layers * kv * tokens * spec.attention.head_dim * c)
    layer = sum(x.size for x in leaves if x.path.startswith("['blocks']")) / spec.n_layers
    parts = {
        "params": sum(leaf_bytes(x, rules, mesh, c) for x in leaves),
        "kv cache": cache,
        "updated kv cache": cache,
        "gathered layer": int(2 * layer * c / splits(("mlp",), rules, mesh)),
        "logits": int(rows * spec.vocab_size / splits(("act_vocab",), rules, mesh) * 4),
    }
    return Estimate(parts)
