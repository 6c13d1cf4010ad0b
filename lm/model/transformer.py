"""The decoder: embed -> N scanned (remat'd) blocks -> final norm -> head."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from lm.model.attention import Attention, rope_tables
from lm.model.layers import Mlp, ModelSpec, Norm, Partitioning, matmul, normal, param

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    spec: ModelSpec
    part: Partitioning

    @nn.compact
    def __call__(self, x, segment_ids, rope_cs):
        x = x + Attention(self.spec, self.part, name="attn")(Norm(self.spec, name="attn_norm")(x), segment_ids, rope_cs)
        x = x + Mlp(self.spec, self.part, name="mlp")(Norm(self.spec, name="mlp_norm")(x))
        return x, None


def scanned_blocks(spec: ModelSpec):
    """Blocks stacked along a leading 'layers' axis: compile time does not grow with depth."""
    block = Block
    if spec.remat != "none":
        block = nn.remat(Block, policy=REMAT_POLICIES[spec.remat], prevent_cse=False)
    return nn.scan(
        block,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=(nn.broadcast, nn.broadcast),
        length=spec.n_layers,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )


class Transformer(nn.Module):
    spec: ModelSpec
    part: Partitioning = Partitioning()

    @nn.compact
    def __call__(self, inputs, segment_ids, positions):
        """inputs/segment_ids/positions: [B, T] int32 -> float32 logits [B, T, vocab]."""
        s, c = self.spec, self.part.constrain
        embedding = param(self, "embedding", normal(s.init_std), (s.vocab_size, s.d_model), ("vocab", "embed"))
        # Gather the fsdp-split table first (as FSDP does for every weight); a vocab-split
        # lookup then stays local per shard instead of replicating the whole activation.
        x = jnp.take(c(embedding, ("vocab", None)), inputs, axis=0).astype(s.dtype)
        if s.position == "learned":
            table = param(self, "pos_embedding", normal(s.init_std), (s.max_seq_len, s.d_model), ("position", "embed"))
            x = x + jnp.take(table, positions, axis=0).astype(s.dtype)
        x = c(x, ("batch", "length", "act_embed"))
        rope_cs = rope_tables(positions, s.head_dim, s.rope_theta) if s.position == "rope" else None
        x, _ = scanned_blocks(s)(s, self.part, name="blocks")(x, segment_ids, rope_cs)
        x = Norm(s, name="final_norm")(x)
        if s.tie_embeddings:
            head = embedding.T
        else:
            head = param(self, "head", normal(s.init_std), (s.d_model, s.vocab_size), ("embed", "vocab"))
        logits = matmul("btd,dv->btv", x, head, out_dtype="float32")
        return c(logits, ("batch", "length", "act_vocab"))


def init_params(model: Transformer, rng: jax.Array, seq_len: int = 8):
    """Boxed (logically partitioned) params for a dummy batch; use under jax.eval_shape or jit."""
    ids = jnp.zeros((1, seq_len), jnp.int32)
    return model.init(rng, ids, jnp.ones_like(ids), ids)["params"]
