"""The decoder: embed -> N scanned (remat'd) blocks -> final norm -> head.

Modes over one set of params: training (`decode=False`: the tokens attend to each other) and
decoding (`decode=True`: prefill and decode steps against the KV cache, see lm.model.cache).
`output="hidden"` returns the final-normed hidden states instead of logits, so other heads
(a scalar reward or value head, lm.model.heads) sit on the same trunk. A pipeline that runs the
loss on its last stage (lm.model.pipeline_1f1b) calls the two ends apart: `output="embedded"`
stops before the blocks, and `hidden=` starts after them.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from lm.model.attention import Attention, softcap
from lm.model.heads import ScalarHead
from lm.model.layers import Mlp, Norm, Partitioning, matmul, normal
from lm.model.moe import MoE
from lm.model.paged import Paging, slots_and_mask
from lm.model.params import param
from lm.model.pipeline import is_pipelined, pipeline_blocks
from lm.model.qdot import take_rows
from lm.model.rope import spec_tables
from lm.model.spec import ModelSpec

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
OUTPUTS = ("logits", "hidden", "scalar", "logits_and_scalar", "embedded")


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)); with post_norms each
    sub-block's output is normed again before the add (Gemma 2/3)."""

    spec: ModelSpec
    part: Partitioning
    decode: bool = False
    paging: Paging | None = None

    @nn.compact
    def __call__(self, x, segment_ids, rope_cs, cache_slots=None, cache_mask=None, local=None):
        s = self.spec
        attn = Attention(s, self.part, self.decode, self.paging, name="attn")
        h = attn(Norm(s, name="attn_norm")(x), segment_ids, rope_cs, cache_slots, cache_mask, local)
        x = x + (Norm(s, name="attn_post_norm")(h) if s.norm.post_norms else h)
        h, aux = Norm(s, name="mlp_norm")(x), None
        if s.moe.n_experts:  # routing statistics per layer: the scan stacks them (lm.model.moe.aux_terms)
            h, aux = MoE(s, self.part, name="moe")(h, segment_ids)
        else:
            h = Mlp(s, self.part, name="mlp")(h)
        x = x + (Norm(s, name="mlp_post_norm")(h) if s.norm.post_norms else h)
        return x, aux


def scanned_blocks(spec: ModelSpec, decode: bool = False):
    """Blocks stacked along a leading 'layers' axis, the KV cache too: compile time does not
    grow with depth. Decoding keeps no residuals for a backward pass, so it is never remat'd."""
    block = Block
    if spec.remat != "none" and not decode:
        block = nn.remat(Block, policy=REMAT_POLICIES[spec.remat], prevent_cse=False)
    return nn.scan(
        block,
        variable_axes={"params": 0, "cache": 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=(nn.broadcast,) * 4 + (0,),  # the last: each layer's local flag (or None)
        length=spec.n_layers,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )


class Transformer(nn.Module):
    spec: ModelSpec
    part: Partitioning = Partitioning()
    scalar_head: bool = False  # a reward / value head beside the LM head (params: 'scalar_head')
    # Decoding only: layers as separate param and cache entries ('layer_0', ...; see
    # `unstack_layers`) run by a Python loop, instead of one stacked entry run by a scan.
    # Slicing a stacked layer out on every decode step copies it on XLA:CPU; separate
    # buffers are read where they are, and each layer's cache is updated in place.
    unstacked: bool = False
    # Decoding only: the KV cache as a pool of pages (lm.model.paged); each call then takes the
    # page table of its rows (`page_table` [B, W]).
    paging: Paging | None = None

    @nn.compact
    def __call__(
        self,
        inputs,
        segment_ids,
        positions,
        decode: bool = False,
        output: str = "logits",
        logits_at=None,
        page_table=None,
        hidden=None,
    ):
        """inputs/segment_ids/positions: [B, T] int32 -> float32 logits [B, T, vocab]
        (output="hidden": [B, T, d_model] in the compute dtype; "scalar": float32 [B, T];
        "logits_and_scalar": both from one pass, as PPO's policy with a value head needs).
        logits_at [B] int32: only the logits of that position of each row, [B, 1, vocab]
        (a prefill needs the last prompt position's, not a [B, T, vocab] array).
        output="embedded": (x [B, T, D], RoPE tables, per-layer local flags), what the blocks take;
        hidden [B, T, D]: the blocks' output, run through the final norm and the heads only."""
        if output not in OUTPUTS:
            raise ValueError(f"output={output!r}: expected one of {OUTPUTS}")
        if "scalar" in output and not self.scalar_head:
            raise ValueError(f"output={output!r} needs a model with scalar_head=True")
        x, embedding = self._embed(inputs, positions, hidden)
        if hidden is None:
            context = self._context(segment_ids, positions, decode, page_table)
            if output == "embedded":
                return x, context[0], context[3]
            x = self._layers(x, segment_ids, *context, decode)
        x = Norm(self.spec, name="final_norm")(x)
        return self._heads(x, embedding, output, logits_at)

    def _embed(self, inputs, positions, hidden=None):
        """Token embeddings (scaled, plus learned positions where the spec says) -> (x, table);
        with `hidden` given, (hidden, table)."""
        s, c = self.spec, self.part.constrain
        shape = (s.vocab_size, s.d_model)
        embedding = param(self, "embedding", normal(s.init_std), shape, ("vocab", "embed"), quantized=True)
        if hidden is not None:
            return hidden, embedding
        # Gather the fsdp-split table first (as FSDP does for every weight); a vocab-split
        # lookup then stays local per shard instead of replicating the whole activation.
        x = take_rows(c(embedding, ("vocab", None)), inputs, s.dtype)
        if s.embed_scale:
            x = x * jnp.asarray(s.d_model**0.5, s.dtype)
        if s.position == "learned":
            table = param(self, "pos_embedding", normal(s.init_std), (s.max_seq_len, s.d_model), ("position", "embed"))
            x = x + jnp.take(table, positions, axis=0).astype(s.dtype)
        return c(x, ("batch", "length", "act_embed")), embedding

    def _context(self, segment_ids, positions, decode: bool, page_table):
        """What every layer reads besides x: (RoPE tables, cache slots, cache mask, per-layer local
        flags). With local layers the tables and masks come as (global, local) pairs."""
        s = self.spec
        rope_cs = spec_tables(s, positions) if s.position == "rope" else None
        if decode and self.paging is not None:
            write, read, mask = slots_and_mask(self.paging, page_table, segment_ids, positions)
            slots = (write, read)
        else:
            slots, mask = self._cache_slots_and_mask(segment_ids, positions) if decode else (None, None)
        local = None
        if s.has_local_layers:
            local = jnp.asarray([t == "local" for t in s.attention.layer_types])
            rope_cs = (rope_cs, spec_tables(s, positions, local=True)) if rope_cs is not None else None
            if decode:
                back = positions[:, :, None] - jnp.arange(mask.shape[-1])[None, None, :]
                mask = (mask, mask & (back < s.attention.sliding_window))
        return rope_cs, slots, mask, local

    def _layers(self, x, segment_ids, rope_cs, slots, mask, local, decode: bool):
        """The blocks: unstacked (a Python loop, decoding), pipelined over stages, or scanned."""
        s = self.spec
        if self.unstacked:
            for i in range(s.n_layers):
                flag = None if local is None else local[i]
                x, _ = Block(s, self.part, decode, self.paging, name=f"layer_{i}")(
                    x, segment_ids, rope_cs, slots, mask, flag
                )
            return x
        if is_pipelined(self.part, decode) and not self.is_initializing():  # init: the plain params
            x, aux = pipeline_blocks(self, Block, REMAT_POLICIES.get(s.remat), x, segment_ids, rope_cs, local), None
        else:
            x, aux = scanned_blocks(s, decode)(s, self.part, decode, self.paging, name="blocks")(
                x, segment_ids, rope_cs, slots, mask, local
            )
        if aux is not None:  # read by lm.model.apply.forward (apply with mutable=["aux"])
            self.sow("aux", "moe", aux)
        return x

    def _heads(self, x, embedding, output: str, logits_at):
        """The outputs of the final-normed x: logits, hidden states, the scalar head or two of them."""
        s, c = self.spec, self.part.constrain
        scalar = None
        if self.scalar_head and (output in ("scalar", "logits_and_scalar") or self.is_initializing()):
            scalar = ScalarHead(s, self.part, name="scalar_head")(x)
            if output == "scalar":
                return scalar
        if output == "hidden":
            return x
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)
        head = (
            embedding.T
            if s.tie_embeddings
            else param(self, "head", normal(s.init_std), (s.d_model, s.vocab_size), ("embed", "vocab"), quantized=True)
        )
        logits = c(matmul(s, "btd,dv->btv", x, head, out_dtype="float32"), ("batch", "length", "act_vocab"))
        logits = softcap(logits, s.final_softcap)
        return (logits, scalar) if output == "logits_and_scalar" else logits

    def _cache_slots_and_mask(self, segment_ids, positions):
        """Each token's cache slot (its position; max_len for padding, i.e. nowhere) and which
        slots each query sees: slots at or before its position holding its own segment."""
        seg_cache = self.variable(
            "cache",
            "segment_ids",
            nn.with_logical_partitioning(jnp.zeros, ("batch", "cache_length")),
            segment_ids.shape,
            jnp.int32,
        )
        max_len = seg_cache.value.shape[1]
        slots = jnp.where(segment_ids != 0, positions, max_len)
        rows = jnp.arange(segment_ids.shape[0])[:, None]
        seg_cache.value = seg_cache.value.at[rows, slots].set(segment_ids, mode="drop")
        visible = jnp.arange(max_len)[None, None, :] <= positions[:, :, None]
        same = seg_cache.value[:, None, :] == segment_ids[:, :, None]
        return slots, visible & same & (segment_ids != 0)[:, :, None]


def unstack_layers(params: dict) -> dict:
    """Params with the stacked 'blocks' entry split into 'layer_0', 'layer_1', ... (for a
    Transformer with unstacked=True); everything else is shared as it is."""
    blocks = params["blocks"]
    n = jax.tree.leaves(blocks)[0].shape[0]
    rest = {k: v for k, v in params.items() if k != "blocks"}
    return rest | {f"layer_{i}": jax.tree.map(lambda x: x[i], blocks) for i in range(n)}


def init_params(model: Transformer, rng: jax.Array, seq_len: int = 8):
    """Boxed (logically partitioned) params for a dummy batch; use under jax.eval_shape or jit."""
    ids = jnp.zeros((1, seq_len), jnp.int32)
    return model.init(rng, ids, jnp.ones_like(ids), ids)["params"]


@functools.lru_cache(maxsize=32)
def abstract_params(model: nn.Module) -> dict:
    """The boxed params' shapes, dtypes and logical axes (ShapeDtypeStructs): nothing allocated.
    Traced once per model (a module is a hashable value): a stage asks for them several times
    (shardings, optimizer state, checks of a base) and each trace costs as much as a forward pass."""
    return jax.eval_shape(lambda r: init_params(model, r), jax.random.PRNGKey(0))
