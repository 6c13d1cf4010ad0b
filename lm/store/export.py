"""`lm export`: the params of one training checkpoint, alone, for inference and fine-tuning.

Two layouts, the same tensors (float32, exactly as trained; the layers are stacked on a
leading axis of size n_layers because the blocks are scanned, whatever the remat policy):

- orbax (PATH is a directory):
    PATH/params/       an orbax PyTree checkpoint of the params tree, e.g. params['blocks']['attn']['wq']
                       with shape [n_layers, d_model, n_heads, head_dim]
    PATH/config.json   the resolved training config (rebuild the model with it)
    PATH/export.json   {"step": ..., "checkpoint": ...}
- safetensors (PATH ends in .safetensors): one file; each tensor is named by its params-tree
  path joined with '/', e.g. 'blocks/attn/wq'; the header metadata holds 'lm_config' (the
  config as JSON) and 'lm_step'.

A run trained with a sentencepiece tokenizer also gets its tokenizer beside the params:
PATH/tokenizer.model, or NAME.tokenizer.model beside NAME.safetensors (`lm sample` reads it).
A model with a Hugging Face tokenizer (imported from an HF directory by `export_loaded`, which
`lm import hf` calls, or a run started from one: it keeps them in WORKDIR/tokenizer/) gets its
tokenizer files in PATH/tokenizer/ or NAME.tokenizer/.

`lm.store.load.load_params(path)` reads either back as a nested dict of numpy arrays. A quantized
export (`export_quantized`, safetensors only) holds integer weights and their scales; `load_trained`
reads it back as quantized params (lm.model.qtensor.QTensor leaves).
"""

from __future__ import annotations

import json
import pathlib
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp

from lm.config import rules_table, with_values
from lm.errors import UserError
from lm.model.build import build_model
from lm.model.params import leaf_paths
from lm.model.quant import quantize_params, quantized_tensors
from lm.outputs import replacing, write_text
from lm.store.checkpoint_read import read_checkpoint_params
from lm.store.load import with_base
from lm.store.loaded import Loaded
from lm.store.meta import config_from, copy_tokenizer, tokenizer_beside
from lm.store.safetensors_files import write_streamed


def out_layout(out, fmt: str | None) -> tuple[pathlib.Path, str]:
    """(out, 'orbax' | 'safetensors'): the layout asked for, or the one the --out suffix names."""
    out = pathlib.Path(out)
    if fmt is None and out.suffix not in ("", ".safetensors"):
        raise UserError(
            f"lm export: --out {out}: a '{out.suffix}' file is neither form lm writes; give a file "
            "ending in .safetensors, or a directory path without a suffix (orbax layout)"
        )
    fmt = fmt or ("safetensors" if out.suffix == ".safetensors" else "orbax")
    if fmt not in ("orbax", "safetensors"):
        raise UserError(f"lm export: --format {fmt!r}: expected 'orbax' or 'safetensors'")
    return out, fmt


def export_params(workdir, out, step: int | None = None, fmt: str | None = None, merge: bool = False) -> dict:
    """Writes the params of `step` (default: newest) to `out`; returns a short summary.

    A LoRA run's checkpoints hold its adapters alone: they are exported alone (with the config
    naming their base, finetune.init), or with merge=True folded into the base as a plain model."""
    out, fmt = out_layout(out, fmt)
    params, meta, step = read_checkpoint_params(workdir, step)
    saved = meta.get("config") or {}
    if merge:
        if not saved.get("model", {}).get("lora_rank"):
            raise UserError(f"lm export --merge: '{workdir}' has no LoRA adapters to merge (model.lora_rank=0)")
        source = f"run '{workdir}'"
        plain, params = merged(config_from(saved, source), params, source)
        saved = plain.to_dict()
    config = json.dumps(saved)
    if fmt == "safetensors":
        from safetensors.numpy import save_file

        flat = {p: np.ascontiguousarray(x) for p, x in zip(leaf_paths(params), jax.tree.leaves(params))}
        with replacing(out) as tmp:
            save_file(flat, str(tmp), metadata={"lm_config": config, "lm_step": str(step)})
        tokenizer_out = out.with_name(out.stem + ".tokenizer.model")
    else:
        _write_orbax(out, params, config, {"step": step, "checkpoint": str(pathlib.Path(workdir).absolute())})
        tokenizer_out = out / "tokenizer.model"
    # a sentencepiece or HF run's; byte runs have none
    _keep_tokenizer(tokenizer_beside(pathlib.Path(workdir)), tokenizer_out.with_suffix(""))
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    return {"step": step, "format": fmt, "params": n, "out": str(out)}


def export_loaded(model: Loaded, out, fmt: str | None = None, merge: bool = False) -> dict:
    """Writes a loaded model (an export, or a Hugging Face directory's lazy params: `lm import hf`)
    in our layout, with its config (the model section as imported) and its tokenizer, so that
    `--params OUT` reads it back anywhere. The safetensors layout is streamed one leaf at a time;
    the orbax layout holds the params on the host once. merge: fold LoRA adapters into the base."""
    out, fmt = out_layout(out, fmt)
    config, params = model.config, model.params
    if merge:
        if not config.model.lora_rank:
            raise UserError(f"lm export --merge: {model.source} has no LoRA adapters to merge (model.lora_rank=0)")
        config, params = merged(config, params, model.source)
    saved = json.dumps(config.to_dict())
    leaves = list(zip(leaf_paths(params), jax.tree.leaves(params)))
    if fmt == "safetensors":
        write_streamed(out, leaves, metadata={"lm_config": saved, "lm_step": "0"})
        beside = out.with_name(out.stem + ".tokenizer")
    else:
        _write_orbax(out, jax.tree.map(np.asarray, params), saved, {"step": 0, "source": model.source})
        beside = out / "tokenizer"
    _keep_tokenizer(model.tokenizer, beside)
    n = sum(int(np.prod(x.shape)) for _, x in leaves)
    return {"step": 0, "format": fmt, "params": n, "out": str(out)}


def merged(config, params: dict, source: str):
    """Adapters folded into their float base (finetune.init; a QLoRA run's too: the base as given,
    not its 4-bit copy) -> (a plain model's config, params)."""
    plain, params = with_base(config, params, source)
    return with_values(plain, {"model.lora_base_quant": "none"}), params


def quantized_out(out) -> pathlib.Path:
    """The --out of a quantized export: a .safetensors file."""
    out = pathlib.Path(out)
    if out.suffix != ".safetensors":
        raise UserError(
            f"lm export --quantize: --out {out}: expected a file ending in .safetensors (the quantized "
            "layout is ours alone; Hugging Face and orbax exports stay float)"
        )
    return out


def export_quantized(model: Loaded, out, mode: str) -> dict:
    """Writes a loaded model's weights quantized (lm.model.quant: int8 per channel or int4 per group,
    LoRA adapters folded in first) to one .safetensors file: each quantized weight as '<path>.q8' or
    '<path>.q4' plus '<path>.scale', everything else as in the float layout; the header says
    'lm_quantization'. `--params OUT` reads it back quantized."""
    out = quantized_out(out)
    config = model.config
    if config.model.lora_rank:
        config, params = merged(config, model.params, model.source)
    else:
        params = model.params
    built = build_model(config, jax.devices()[:1], rules=rules_table(config))
    built.check(params, model.source)
    tensors = quantized_tensors(quantize_params(jax.tree.map(np.asarray, params), built.spec, mode))
    from safetensors.numpy import save_file

    with replacing(out) as tmp:
        save_file(
            {k: np.ascontiguousarray(v) for k, v in tensors.items()},
            str(tmp),
            metadata={"lm_config": json.dumps(config.to_dict()), "lm_step": "0", "lm_quantization": mode},
        )
    _keep_tokenizer(model.tokenizer, out.with_name(out.stem + ".tokenizer"))
    return {
        "step": 0,
        "format": f"safetensors, {mode}",
        "params": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)),
        "out": str(out),
        "bytes": sum(v.nbytes for v in tensors.values()),
    }


def _write_orbax(out: pathlib.Path, params: dict, config_json: str, info: dict) -> None:
    """The orbax layout: OUT/params (a PyTree checkpoint, written beside and swapped in whole),
    OUT/config.json, OUT/export.json. Nothing else in OUT is touched."""
    out.mkdir(parents=True, exist_ok=True)
    with replacing(out / "params", directory=True) as tmp:
        ckptr = ocp.PyTreeCheckpointer()
        ckptr.save(tmp.absolute(), args=ocp.args.PyTreeSave(params))
        ckptr.close()
    write_text(out / "config.json", config_json)
    write_text(out / "export.json", json.dumps(info))


def _keep_tokenizer(tok, beside: pathlib.Path) -> None:
    """A sentencepiece model as BESIDE.model; a Hugging Face tokenizer's files in BESIDE/
    (lm.store.meta.copy_tokenizer). A tokenizer of the other kind that an earlier export to the
    same place left there is removed: it would be read back with this model."""
    path = tok if isinstance(tok, pathlib.Path) else getattr(tok, "path", None)  # a tokenizer or its files
    kept = None if path is None else copy_tokenizer(pathlib.Path(path), beside)  # None: the byte tokenizer
    spm, hf = beside.with_name(beside.name + ".model"), beside
    if kept != spm and spm.is_file():
        spm.unlink()
    if kept != hf and (hf / "tokenizer.json").is_file():
        shutil.rmtree(hf)
