"""The `model` section: the architecture and how it runs. Defaults are the tiny CPU model.

Its frozen form is lm.model.layers.ModelSpec (the model knows no config), built by
`ModelSpec.from_config`; derived values such as `head_dim` are computed here, once.
"""

from __future__ import annotations

from lm.config.core import require

# The projections LoRA can adapt (lm.model.lora), by param name.
LORA_TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "w_in")

# head_dim 0: d_model // n_heads. LoRA (lm.model.lora): rank 0 = off; targets among LORA_TARGETS.
DEFAULTS = dict(
    vocab_size=320, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=0,
    d_ff=384, mlp="swiglu", norm="rmsnorm", use_bias=False, position="rope",
    max_seq_len=256, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=True,
    compute_dtype="float32", attention="blockwise", remat="none", init_std=0.02, kernels="auto",
    lora_rank=0, lora_alpha=16.0, lora_dropout=0.0, lora_targets=LORA_TARGETS,
)

CHOICES = dict(
    mlp=("swiglu", "gelu"),
    norm=("rmsnorm", "layernorm"),
    position=("rope", "learned"),
    compute_dtype=("float32", "bfloat16"),
    attention=("xla", "cudnn", "reference", "blockwise"),
    remat=("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable"),
    # "cpu": lm.model.cpu_kernels (hand-written backward passes for XLA:CPU); "plain": einsum +
    # autodiff, which XLA fuses on GPU/TPU; "auto": cpu on the CPU backend, plain elsewhere
    kernels=("auto", "cpu", "plain"),
)


def head_dim(m) -> int:
    """Per-head width; 0 in the config means derive it as d_model // n_heads."""
    return m.head_dim or m.d_model // m.n_heads


def check(c) -> None:
    m = c.model
    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len"):
        require(m[key] > 0, f"model.{key}", m[key], "expected a positive integer")
    require(m.head_dim > 0 or m.d_model % m.n_heads == 0, "model.n_heads", m.n_heads,
            f"must divide model.d_model={m.d_model} (or set model.head_dim)")
    require(m.lora_rank >= 0, "model.lora_rank", m.lora_rank, "expected >= 0 (0 = no adapters)")
    require(m.lora_alpha > 0, "model.lora_alpha", m.lora_alpha, "expected > 0")
    require(0.0 <= m.lora_dropout < 1.0, "model.lora_dropout", m.lora_dropout, "expected a rate in [0, 1)")
    require(set(m.lora_targets) <= set(LORA_TARGETS) and m.lora_targets, "model.lora_targets", m.lora_targets,
            f"expected names among {LORA_TARGETS}")
    require(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads", m.n_kv_heads,
            f"must divide model.n_heads={m.n_heads}")
    require(m.position != "rope" or head_dim(m) % 2 == 0, "model.head_dim", head_dim(m),
            "RoPE needs an even head dimension")
