"""Models out as Hugging Face directories: `export_hf` writes a checkpoint that transformers'
`AutoModelForCausalLM` and `AutoTokenizer` load (config.json, safetensors shards, generation
config, tokenizer and chat template); `export_peft` writes a LoRA run's adapters as a PEFT
adapter over its base.

A model imported from Hugging Face goes back as its own family (config.model.family); a model
trained here goes out as `LlamaForCausalLM` when its architecture is a Llama's
(lm.store.hf.families.llama.unsupported names what keeps it from being one), as
`Qwen3ForCausalLM` when it is a Llama's with QK-norm (model.qk_norm), and with experts
(model.n_experts > 0) as `MixtralForCausalLM` or, with QK-norm, `Qwen3MoeForCausalLM`. Tensors are streamed:
each HF tensor is cut from its params leaf (one layer of a stacked leaf) when the writer asks
for it, so beyond the shard being written only one tensor is on the host at a time, and lazy
params (lm.store.hf.reader) read only that layer.
"""

from __future__ import annotations

import json
import pathlib

import jax
import ml_dtypes
import numpy as np

from lm.config import init_of
from lm.errors import UserError
from lm.model.fp8 import without_histories
from lm.model.lora import SUFFIX_A, SUFFIX_B
from lm.model.params import leaf_paths
from lm.model.spec import ModelSpec
from lm.outputs import replacing, write_text
from lm.store.hf.config import is_hf_dir
from lm.store.hf.families import family_of, llama, mixtral, qwen, qwen_moe
from lm.store.hf.families.common import to_hf
from lm.store.hf.tokenizer import write_tokenizer
from lm.store.load import with_base
from lm.store.loaded import Loaded
from lm.store.safetensors_files import write_sharded

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
SHARD_BYTES = 5 * 2**30
PEFT_WEIGHTS, PEFT_CONFIG = "adapter_model.safetensors", "adapter_config.json"


def hf_family(m, source: str = "the model"):
    """The family module a model section exports as: its own, or for a model trained here Llama
    (Mixtral with experts), Qwen3 with QK-norm (Qwen3-MoE with experts)."""
    if m.family:
        return family_of(m.family, source)
    family, name = {
        (False, False): (llama, "Llama"),
        (True, False): (mixtral, "Mixtral"),
        (False, True): (qwen, "Qwen3"),
        (True, True): (qwen_moe, "Qwen3-MoE"),
    }[bool(m.n_experts), bool(m.qk_norm)]
    bad = family.unsupported(m)
    if bad:
        raise UserError(f"{source} cannot be written as a Hugging Face {name} checkpoint: {'; '.join(bad)}")
    return family


def export_hf(
    model: Loaded, out, *, merge: bool = False, dtype: str | None = None, max_bytes: int = SHARD_BYTES
) -> dict:
    """Writes `model` as a Hugging Face model directory `out`; returns a short summary.

    A LoRA model (config.model.lora_rank > 0) is written only with merge=True: its adapters
    folded into the base (lm.store.load.with_base). dtype: 'float32', 'bfloat16' or 'float16'
    (default: the embedding's, float32 for a model trained here). Shards hold at most max_bytes."""
    config, params = _plain(model, merge)
    m = config.model
    family = hf_family(m, model.source)
    maps = family.tensors(ModelSpec.from_config(m))
    _check_leaves(params, maps, model.source)
    np_dtype = _dtype(dtype, params)
    out = _directory(out)
    ids = write_tokenizer(model.tokenizer, out, m.max_seq_len)
    name = np.dtype(np_dtype).name
    hf = family.hf_config(m) | {
        "torch_dtype": name,
        "dtype": name,
        "bos_token_id": ids.bos,
        "eos_token_id": ids.eos[0],
        "pad_token_id": ids.pad,
    }
    write_text(out / "config.json", json.dumps(hf, indent=2) + "\n")
    files = write_sharded(out, hf_tensors(maps, m.n_layers, params, np_dtype), max_bytes, metadata={"format": "pt"})
    return {
        "out": str(out),
        "architecture": hf["architectures"][0],
        "dtype": name,
        "files": files,
        "params": sum(int(np.prod(x.shape)) for x in _leaves(params).values()),
    }


def hf_tensors(maps, n_layers: int, params: dict, dtype):
    """(HF name, array) pairs, each made when asked for: a stacked leaf is read one layer at a time
    (an expert leaf's layer holds one HF tensor per expert)."""
    for t in maps:
        leaf = _leaf(params, t.lm)
        like_2d = t.lm == "embedding"
        if t.stacked:
            for i in range(n_layers):
                layer = _layer(leaf, i)
                for e, part in enumerate(layer if t.experts else [layer]):
                    yield t.hf.format(i=i, e=e), _cast(to_hf(t.kind, part, like_2d), dtype)
        else:
            yield t.hf, _cast(to_hf(t.kind, np.asarray(leaf), like_2d), dtype)


def export_peft(model: Loaded, out, *, base: str | None = None, dtype: str | None = None) -> dict:
    """Writes a LoRA model's adapters as a PEFT adapter directory: adapter_config.json and
    adapter_model.safetensors with PEFT's names and layout (lora_A [r, in], lora_B [out, r],
    scaled by lora_alpha / r), and the tokenizer. `PeftModel.from_pretrained(base model, out)`
    then computes what our merged model computes. base: base_model_name_or_path (default: the
    Hugging Face directory the run started from, when it started from one)."""
    config, params = model.config, model.params
    m = config.model
    if not m.lora_rank:
        raise UserError(f"{model.source} has no LoRA adapters (model.lora_rank=0): export it with --format hf")
    tensors, targets = peft_tensors(hf_family(m, model.source), m, params, _dtype(dtype, None), model.source)
    init = init_of(config)
    if base is None and init and is_hf_dir(init):
        base = str(pathlib.Path(init).resolve())
    alpha = int(m.lora_alpha) if float(m.lora_alpha).is_integer() else float(m.lora_alpha)
    adapter = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": m.lora_rank,
        "lora_alpha": alpha,
        "lora_dropout": m.lora_dropout,
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "modules_to_save": None,
        "init_lora_weights": True,
        "layers_to_transform": None,
    }
    from safetensors.numpy import save_file

    out = _directory(out)
    with replacing(out / PEFT_WEIGHTS) as tmp:
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    write_text(out / PEFT_CONFIG, json.dumps(adapter, indent=2) + "\n")
    write_tokenizer(model.tokenizer, out, m.max_seq_len)
    return {
        "out": str(out),
        "targets": sorted(targets),
        "rank": m.lora_rank,
        "base": base,
        "params": sum(int(v.size) for v in tensors.values()),
    }


def peft_tensors(family, m, params: dict, dtype, source: str) -> tuple[dict, set]:
    """({PEFT name: array}, target module names) for the adapters in `params`: ours are A [inputs..., r]
    and B [r, outputs...] per layer, PEFT's lora_A [r, in] and lora_B [out, r] (inputs and outputs
    flattened as the family's linear weights are)."""
    modules = {t.lm: t for t in family.tensors(ModelSpec.from_config(m))}
    leaves = _leaves(params)
    adapted = sorted(p[: -len(SUFFIX_A)] for p in leaves if p.endswith(SUFFIX_A))
    if not adapted:
        raise UserError(f"{source}: model.lora_rank={m.lora_rank} but its params hold no adapters")
    tensors, targets, r = {}, set(), m.lora_rank
    for path in adapted:
        if path not in modules or not modules[path].hf.endswith(".weight") or modules[path].experts:
            raise UserError(
                f"{source}: adapters on '{path}', which has no Hugging Face {family.__name__.rsplit('.', 1)[-1]} module"
            )
        module = modules[path].hf.removesuffix(".weight")
        targets.add(module.rsplit(".", 1)[-1])
        a, b = leaves[path + SUFFIX_A], leaves[path + SUFFIX_B]
        for i in range(m.n_layers) if modules[path].stacked else [None]:
            ai, bi = (_layer(a, i), _layer(b, i)) if i is not None else (np.asarray(a), np.asarray(b))
            name = f"base_model.model.{module.format(i=i)}"
            tensors[f"{name}.lora_A.weight"] = _cast(ai.reshape(-1, r).T, dtype)
            tensors[f"{name}.lora_B.weight"] = _cast(bi.reshape(r, -1).T, dtype)
    return tensors, targets


def _plain(model: Loaded, merge: bool) -> tuple:
    """(config, params) without adapters (a LoRA model's folded into its base when merge is asked)
    and without delayed fp8 scaling's amax histories."""
    config, params = model.config, model.params
    if params is not None:
        params = without_histories(params)
    if not config.model.lora_rank:
        return config, params
    if not merge:
        raise UserError(
            f"{model.source} holds LoRA adapters (model.lora_rank={config.model.lora_rank}): add --merge "
            "to fold them into the base, or write them alone with --format peft"
        )
    return with_base(config, params, model.source)


def _check_leaves(params: dict, maps, source: str) -> None:
    """Every mapped leaf is there and every leaf is mapped (a scalar head, say, has no place)."""
    names = set(_leaves(params))
    mapped = {t.lm for t in maps}
    for path in sorted(mapped - names):
        raise UserError(f"{source}: params have no '{path}', which the checkpoint needs")
    for path in sorted(names - mapped):
        raise UserError(f"{source}: params '{path}' have no place in a Hugging Face checkpoint of this family")


def _dtype(dtype: str | None, params: dict | None):
    """The dtype asked for; by default the embedding's (float32 without params: adapters)."""
    if dtype is None:
        return np.dtype(_leaf(params, "embedding").dtype if params is not None else np.float32)
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    return np.dtype(DTYPES[dtype])


def _cast(x: np.ndarray, dtype) -> np.ndarray:
    x = np.asarray(x)
    return x.astype(dtype) if np.issubdtype(x.dtype, np.floating) or x.dtype == ml_dtypes.bfloat16 else x


def _layer(leaf, i: int) -> np.ndarray:
    """Layer i of a stacked leaf (numpy, jax or lazy: a slice reads only that layer)."""
    return np.asarray(leaf[i : i + 1])[0]


def _leaves(params: dict) -> dict:
    return dict(zip(leaf_paths(params), jax.tree.leaves(params)))


def _leaf(params: dict, path: str):
    node = params
    for part in path.split("/"):
        node = node[part]
    return node


def _directory(out) -> pathlib.Path:
    """`out` as a directory (created if missing). Files are replaced one by one; the weight files
    of a previous export that this one does not write are removed once the new ones are in place
    (lm.store.safetensors_files.write_sharded)."""
    out = pathlib.Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    return out
