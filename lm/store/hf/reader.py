"""Hugging Face checkpoints in: a model directory (config.json, *.safetensors, tokenizer files) as a
`Loaded` model that any stage, sampler or evaluator takes.

Its params are lazy: each leaf is a `LazyTensor` that reads its Hugging Face tensors (one per
layer for stacked leaves) only when asked, and only the part asked for. `Built.place` asks each
device for its own shard, so a checkpoint goes from disk to its sharding on the run's mesh
without a whole-model host copy, in the checkpoint's dtype (bf16 stays bf16).
"""

from __future__ import annotations

import itertools
import math
import pathlib

import flax.linen as nn
import jax
import numpy as np

from lm.data.tokenizer import load_tokenizer
from lm.errors import UserError
from lm.model.params import leaf_paths
from lm.model.spec import ModelSpec
from lm.model.transformer import Transformer, abstract_params
from lm.store.hf.config import hf_config, is_hf_dir, read_hf_config
from lm.store.hf.families import family_of
from lm.store.hf.families.common import layout_view, stored_shapes
from lm.store.loaded import Loaded
from lm.store.safetensors_files import FLOATS, NAMES, TensorFiles, aligned_empty

__all__ = ["LazyTensor", "hf_config", "is_hf_dir", "lazy_params", "load_hf"]
TRANSPOSE_ROWS = 64  # stored rows per block of a transposing copy


class LazyTensor:
    """A params leaf read on demand from an HF checkpoint: `x[index]` reads only that part.

    Its first `lead` axes pick the HF tensor (0: one tensor; 1: one per layer; 2: one per layer
    and expert), `names` listing them in that order (layer-major)."""

    def __init__(self, files: TensorFiles, names: list[str], kind: str, shape: tuple, dtype, lead: int):
        self.files, self.names, self.kind, self.lead = files, names, kind, lead
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __getitem__(self, index) -> np.ndarray:
        """The part `index` (basic slices) selects: from each layer's tensor only the rows that hold
        it are read (`_plan`), and only the selected part is copied, layer by layer, into one
        aligned array (which XLA:CPU then takes without a copy of its own)."""
        index = index if isinstance(index, tuple) else (index,)
        index = tuple(index) + (slice(None),) * (self.ndim - len(index))
        shape = tuple(len(range(*i.indices(n))) for i, n in zip(index, self.shape))
        if not self.lead:
            whole = self._whole_rows(index)
            if whole is not None:
                return whole
        out = aligned_empty(shape, self.dtype)
        if not self.lead:
            self._fill(out, self.names[0], self.shape, index)
        else:  # one HF tensor per layer (and expert), each filling its part of `out`
            lead = self.lead
            picked = [range(n)[i] for i, n in zip(index[:lead], self.shape[:lead])]
            for at in itertools.product(*(range(len(r)) for r in picked)):
                which = tuple(r[j] for r, j in zip(picked, at))
                name = self.names[int(np.ravel_multi_index(which, self.shape[:lead]))]
                self._fill(out[at], name, self.shape[lead:], index[lead:])
        if self.kind == "id+1":
            out += 1.0
        return out

    def _fill(self, out: np.ndarray, name: str, per_layer: tuple, index: tuple) -> None:
        rows, shape, index = self._plan(name, per_layer, index)
        part = layout_view(self.kind, self.files.read(name, rows), shape)[index]
        if out.dtype == part.dtype and out.dtype.itemsize == 2:  # numpy copies bfloat16 slowly: as uint16
            out, part = out.view(np.uint16), part.view(np.uint16)
        if self.kind not in ("T1", "T2"):
            np.copyto(out, part, casting="unsafe")
            return
        # A transposing copy, in blocks of ~64 stored rows: twice as fast as one strided copy.
        axis = 1 if self.kind == "T1" else out.ndim - 1
        inner = math.prod(out.shape[axis + 1 :]) if self.kind == "T1" else 1
        step = max(1, TRANSPOSE_ROWS // inner)
        for start in range(0, out.shape[axis], step):
            block = (slice(None),) * axis + (slice(start, start + step),)
            np.copyto(out[block], part[block], casting="unsafe")

    def _whole_rows(self, index: tuple) -> np.ndarray | None:
        """The read itself, when a shard is a range of whole rows of the tensor as it is stored."""
        rows, shape, rest = self._plan(self.names[0], self.shape, index)
        if self.kind != "id" or rows is None or any(i != slice(None) for i in rest[1:]):
            return None
        return self.files.read(self.names[0], rows).reshape(shape)

    def _plan(self, name: str, per_layer: tuple, index: tuple) -> tuple:
        """(the stored tensor's rows to read, our layout of those rows, the index into it): only the
        rows that hold the part asked for, when they are one range. The stored rows are our
        output axes, flattened (a linear weight [out, in]: "T1" our axes 1.., "T2" our last axis),
        or our first axis (the embedding, as stored; the experts of a fused "E" tensor)."""
        everything = (None, per_layer, index)
        if (self.kind == "id" and len(per_layer) >= 2 and self.files.shape(name) == per_layer) or self.kind.startswith(
            "E"
        ):
            out_axes = [0]
        elif self.kind in ("T1", "T2"):
            out_axes = list(range(1, len(per_layer))) if self.kind == "T1" else [len(per_layer) - 1]
        else:
            return everything
        first = out_axes[0]
        start, stop, step = index[first].indices(per_layer[first])
        if step != 1 or any(index[a].indices(per_layer[a]) != (0, per_layer[a], 1) for a in out_axes[1:]):
            return everything
        inner = math.prod(per_layer[a] for a in out_axes[1:])
        shape = per_layer[:first] + (stop - start,) + per_layer[first + 1 :]
        return slice(start * inner, stop * inner), shape, index[:first] + (slice(None),) + index[first + 1 :]

    def __array__(self, dtype=None, copy=None):
        x = self[()]
        return x if dtype is None else x.astype(dtype)

    def astype(self, dtype):
        return np.asarray(self).astype(dtype)


def lazy_params(path, spec: ModelSpec, source: str) -> dict:
    """Our params tree of LazyTensors over the checkpoint in `path`: every tensor the family maps
    must be there with the shape it implies (checked here, before anything is read)."""
    hf = read_hf_config(path)
    family = family_of(hf.get("model_type", "?"), source)
    files = TensorFiles(path)
    abstract = nn.unbox(abstract_params(Transformer(spec)))
    shapes = dict(zip(leaf_paths(abstract), [tuple(x.shape) for x in jax.tree.leaves(abstract)]))
    tree: dict = {}
    for m in family.tensors(spec):
        if m.lm not in shapes:
            raise UserError(f"{source}: internal mapping names '{m.lm}', which the model does not have")
        shape = shapes[m.lm]
        m = m.as_stored(files)
        names = m.names(spec.n_layers, spec.moe.n_experts)
        per_layer = shape[m.lead :]
        expected = stored_shapes(m.kind, per_layer)
        for name in names:
            if name not in files:
                raise UserError(f"{source}: tensor '{name}' is missing from the checkpoint")
            if files.shape(name) not in expected:
                raise UserError(
                    f"{source}: tensor '{name}' has shape {files.shape(name)}; config.json implies "
                    f"{' or '.join(map(str, expected))}"
                )
            if NAMES[files.dtype(name)] not in FLOATS:
                raise UserError(
                    f"{source}: tensor '{name}' has dtype {NAMES[files.dtype(name)]}; expected a "
                    f"floating dtype ({', '.join(sorted(FLOATS))})"
                )
        dtype = np.float32 if m.kind == "id+1" else files.dtype(names[0])
        node = tree
        *parents, leaf = m.lm.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = LazyTensor(files, names, m.kind, shape, dtype, m.lead)
    return tree


def load_hf(path, tokenizer: str | None = None):
    """`Loaded(config, lazy params, tokenizer, source)` for an HF model directory."""
    path = pathlib.Path(path)
    source = f"Hugging Face model '{path}'"
    config = hf_config(path)
    spec = ModelSpec.from_config(config.model)
    params = lazy_params(path, spec, source)
    tok = load_tokenizer(tokenizer or str(path))
    if tok.vocab_size > config.model.vocab_size:
        raise UserError(
            f"the tokenizer has {tok.vocab_size} ids but {source} has vocab_size="
            f"{config.model.vocab_size}: it is not the model's tokenizer"
        )
    return Loaded(config, params, tok, source)
