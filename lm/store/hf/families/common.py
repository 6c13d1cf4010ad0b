"""What the Hugging Face families share in naming tensors: tensor maps, the layout transforms, and
the maps of the decoder Llama, Mistral, Qwen and Gemma share and of an MoE block's router and
experts. Reading and writing config.json is lm.store.hf.families.config_keys.

A tensor map names, for one leaf of our params tree ('blocks/attn/wq', stacked over layers when
its path starts with 'blocks/'), the Hugging Face tensor ('model.layers.{i}.self_attn.q_proj.weight')
and the layout transform between them:

- "T1": a linear weight, HF [out, in] <-> ours [in, out...] (one input axis: wq [d, n, h], w_gate [d, f])
- "T2": the same with two input axes (wo [n, h, d] <- o_proj [d, n*h])
- "id": the same values, reshaped (norms, biases, the embedding)
- "id+1": a norm stored as (1 + w) by Gemma: ours holds the product's factor itself
- "E", "E/0", "E/1" (import only): the experts of a layer fused in one tensor [E, out, in] <-> ours
  [E, in, out]; "E/0" and "E/1" take the first and second half of its outputs (gate_up_proj:
  the gate rows, then the up rows)

An expert leaf ('blocks/moe/w_gate' [L, E, ...]) stored one tensor per expert names it with '{e}'
as well ('model.layers.{i}.mlp.experts.{e}.gate_proj.weight'). A map's `alt` lists the other
layouts a checkpoint may store the same leaf in; the importer takes the one it finds.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class TensorMap:
    lm: str  # params-tree path, '/'-joined
    hf: str  # the HF tensor's name; '{i}' stands for the layer index when stacked, '{e}' for the expert's
    kind: str = "id"
    alt: tuple = ()  # other layouts of the same leaf (TensorMaps), for import

    @property
    def stacked(self) -> bool:
        return self.lm.startswith("blocks/")

    @property
    def experts(self) -> bool:
        """One HF tensor per expert (and layer): the leaf's axis after the layers is the experts'."""
        return "{e}" in self.hf

    @property
    def lead(self) -> int:
        """The leaf's leading axes that pick an HF tensor: 0 (one tensor), 1 (layers), 2 (and experts)."""
        return int(self.stacked) + int(self.experts)

    def names(self, n_layers: int, n_experts: int) -> list[str]:
        """The HF tensors of the leaf, layer-major (layer 0's experts, then layer 1's, ...)."""
        if not self.stacked:
            return [self.hf]
        return [self.hf.format(i=i, e=e) for i in range(n_layers) for e in range(n_experts if self.experts else 1)]

    def as_stored(self, stored) -> "TensorMap":
        """This map, or the first of its `alt` layouts whose first tensor `stored` (a checkpoint's
        tensor names) holds; this map when none is there (the missing tensor is then reported)."""
        for m in (self, *self.alt):
            if m.hf.format(i=0, e=0) in stored:
                return m
        return self


def layout_view(kind: str, x: np.ndarray, shape: tuple) -> np.ndarray:
    """An HF tensor as our per-layer leaf of `shape`, as a strided view where numpy can make one
    (a loader slices it and copies only the part a device holds); "id+1" leaves still need their +1."""
    if kind.startswith("E"):
        if kind in ("E/0", "E/1"):  # one half of the outputs
            half = x.shape[1] // 2
            start = half * int(kind[-1])
            x = x[:, start : start + half]
        return x.transpose(0, 2, 1).reshape(shape)
    return (x.T if kind in ("T1", "T2") else x).reshape(shape)


def stored_shapes(kind: str, shape: tuple) -> list[tuple]:
    """The shapes an HF tensor may have for our per-layer leaf of `shape` (the inverse of `layout_view`)."""
    if kind in ("T1", "T2"):
        n_in = 1 if kind == "T1" else len(shape) - 1
        return [(math.prod(shape[n_in:]), math.prod(shape[:n_in]))]
    if kind.startswith("E"):  # ours [E, in, out...] <- [E, out, in]; "E/0", "E/1": half of the outputs
        outs = math.prod(shape[2:]) * (2 if kind in ("E/0", "E/1") else 1)
        return [(shape[0], outs, shape[1])]
    return [tuple(shape), (math.prod(shape),)] if len(shape) != 1 else [tuple(shape)]


def to_hf(kind: str, x: np.ndarray, like_2d: bool = False) -> np.ndarray:
    """Our per-layer leaf as the HF tensor (the inverse of `layout_view`, +1 included; the fused
    expert layouts are read only)."""
    if kind.startswith("E"):
        raise ValueError(f"layout '{kind}' is for import only")
    if kind in ("T1", "T2"):
        n_in = 1 if kind == "T1" else 2
        rows = math.prod(x.shape[:n_in])
        return np.ascontiguousarray(x.reshape(rows, -1).T)
    if kind == "id+1":
        return (np.asarray(x, np.float32) - 1.0).reshape(-1)
    return x if like_2d else x.reshape(-1)


def llama_like(
    spec, norm_kind: str = "id", bias: bool = False, qk_norm: bool = False, post_norms: bool = False
) -> list[TensorMap]:
    """The decoder's tensors under the names Llama, Mistral, Qwen and Gemma share."""
    layer = "model.layers.{i}."
    maps = [
        TensorMap("embedding", "model.embed_tokens.weight"),
        TensorMap("final_norm/scale", "model.norm.weight", norm_kind),
        TensorMap("blocks/attn_norm/scale", layer + "input_layernorm.weight", norm_kind),
    ]
    for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj")):
        maps.append(TensorMap(f"blocks/attn/{ours}", layer + f"self_attn.{theirs}.weight", "T1"))
        if bias:
            maps.append(TensorMap(f"blocks/attn/{ours}_bias", layer + f"self_attn.{theirs}.bias"))
    maps.append(TensorMap("blocks/attn/wo", layer + "self_attn.o_proj.weight", "T2"))
    if qk_norm:
        maps += [
            TensorMap("blocks/attn/q_norm/scale", layer + "self_attn.q_norm.weight", norm_kind),
            TensorMap("blocks/attn/k_norm/scale", layer + "self_attn.k_norm.weight", norm_kind),
        ]
    if post_norms:
        maps += [
            TensorMap("blocks/attn_post_norm/scale", layer + "post_attention_layernorm.weight", norm_kind),
            TensorMap("blocks/mlp_norm/scale", layer + "pre_feedforward_layernorm.weight", norm_kind),
            TensorMap("blocks/mlp_post_norm/scale", layer + "post_feedforward_layernorm.weight", norm_kind),
        ]
    else:
        maps.append(TensorMap("blocks/mlp_norm/scale", layer + "post_attention_layernorm.weight", norm_kind))
    if not spec.moe.n_experts:  # an MoE block's experts: `expert_maps`
        for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
            maps.append(TensorMap(f"blocks/mlp/{ours}", layer + f"mlp.{theirs}.weight", "T1"))
    if not spec.tie_embeddings:
        maps.append(TensorMap("head", "lm_head.weight", "T1"))
    return maps


def expert_maps(prefixes: tuple[str, ...], names: tuple[str, str, str]) -> list[TensorMap]:
    """An MoE block's router ('<prefix>gate.weight') and experts ('blocks/moe/...'), stored per
    expert as '<prefix>experts.{e}.<name>.weight' (names: the gate, up and down projections) under
    prefixes[0]: what transformers writes and reads. On import also under the other prefixes, and
    fused as transformers holds them in memory: experts.gate_up_proj [E, 2 * f, d] (the gate rows,
    then the up rows) and experts.down_proj [E, d, f]."""
    ours = ("w_gate", "w_up", "w_down")
    per_expert = [
        [TensorMap(f"blocks/moe/{o}", f"{p}experts.{{e}}.{t}.weight", "T1") for o, t in zip(ours, names)]
        for p in prefixes
    ]
    fused = [
        [
            TensorMap(f"blocks/moe/{o}", p + f"experts.{t}", k)
            for o, t, k in zip(ours, ("gate_up_proj", "gate_up_proj", "down_proj"), ("E/0", "E/1", "E"))
        ]
        for p in prefixes
    ]
    routers = [TensorMap("blocks/moe/router", p + "gate.weight", "T1") for p in prefixes]
    maps = [dataclasses.replace(routers[0], alt=tuple(routers[1:]))]
    for first, *others in zip(*per_expert, *fused):
        maps.append(dataclasses.replace(first, alt=tuple(others)))
    return maps
