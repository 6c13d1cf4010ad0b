"""Hugging Face architectures, one module each: config.json -> our model section, our params tree
<-> their tensor names, and back (export). `family_of(model_type)` picks the module."""

from __future__ import annotations

from lm.errors import UserError
from lm.store.hf.families import gemma, llama, mixtral, qwen, qwen_moe

FAMILIES = {t: module for module in (llama, qwen, gemma, mixtral, qwen_moe) for t in module.MODEL_TYPES}


def family_of(model_type: str, source: str = "config.json"):
    """The module of a model_type; a clear error naming the supported ones otherwise."""
    if model_type not in FAMILIES:
        hint = " (a multimodal Gemma 3: import its language model, Gemma3ForCausalLM)" if model_type == "gemma3" else ""
        raise UserError(
            f"{source}: model_type '{model_type}' is not supported{hint}; supported: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]
