"""Tiny random Hugging Face checkpoints written by transformers' own `save_pretrained` (no
downloads): one per architecture variant the importer supports."""

from __future__ import annotations

import pathlib

SHAPE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,
)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}

# name -> (config class, model class, config keys): GQA everywhere; tied and untied heads; q/k/v
# biases; q/k norms; head_dim != hidden / heads; each RoPE scaling; sliding windows shorter than
# the test sequences.
VARIANTS = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False, rope_scaling=LLAMA3)),
    "llama-linear-tied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    ),
    "llama-yarn": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling=YARN)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24, tie_word_embeddings=False)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, query_pre_attn_scalar=20, sliding_window=8)),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=16,
            query_pre_attn_scalar=20,
            sliding_window=8,
            sliding_window_pattern=2,
            rope_scaling={"rope_type": "linear", "factor": 4.0},
        ),
    ),
}

# One variant per family: where a test trains or adapts, the RoPE variants add nothing.
FAMILIES = ("llama3", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")

# Mixtures of experts (tests/store/hf/test_moe.py): 4 experts, 2 per token; the router's random
# weights at initializer_range 0.1 give every token distinct top-2 scores. Sliding windows (on
# every layer, as both families have them) shorter than the test sequences.
MOE_SHAPE = SHAPE | dict(vocab_size=128, num_hidden_layers=2, num_experts_per_tok=2)
MOE_VARIANTS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, sliding_window=8)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=4, moe_intermediate_size=48, norm_topk_prob=True, head_dim=24),
    ),
    "qwen3_moe-unnormed": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_experts=4,
            moe_intermediate_size=48,
            norm_topk_prob=False,
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=8,
        ),
    ),
}


def write_model(name: str, out, seed: int = 0, dtype: str = "float32", **shape):
    """Saves the variant's random model to `out` (SHAPE, or MOE_SHAPE, keys overridden by `shape`);
    returns the torch model (eval mode)."""
    import torch
    import transformers

    config_cls, model_cls, keys = (VARIANTS | MOE_VARIANTS)[name]
    base = MOE_SHAPE if name in MOE_VARIANTS else SHAPE
    torch.manual_seed(seed)
    # eager attention: the reference computation itself (transformers 5.17 defaults Gemma 2 to SDPA,
    # which drops its attention soft-capping: 5e-4 off on these logits)
    config = getattr(transformers, config_cls)(**(base | shape), **keys, attn_implementation="eager")
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # norms away from their init, so a mis-mapped norm shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(pathlib.Path(out))
    return model


def write_tokenizer(out, vocab: int = SHAPE["vocab_size"]) -> None:
    """A word-level tokenizer over `vocab` ids (ids only matter here), saved as transformers saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<s>": 0, "</s>": 1, "<pad>": 2} | {f"w{i}": i for i in range(3, vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(pathlib.Path(out))
