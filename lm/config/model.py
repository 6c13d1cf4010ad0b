"""The `model` section: the architecture and how it runs. Defaults are the tiny CPU model.

Its frozen form is lm.model.spec.ModelSpec (the model knows no config), built by
`ModelSpec.from_config`; derived values such as `head_dim` are computed here, once.
"""

from __future__ import annotations

from lm.config.core import require

# The projections LoRA can adapt (lm.model.lora), by param name.
LORA_TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "w_in")

# Variations that published architectures need (lm.store.hf.families maps them from a Hugging Face
# config.json); the defaults are the plain decoder trained here.
ARCHITECTURE = dict(
    family="",  # the Hugging Face model_type it came from ("": trained here; exports as llama, mixtral with experts)
    qkv_bias=False,  # biases on the q/k/v projections only (Qwen2); use_bias puts them everywhere
    qk_norm=False,  # RMSNorm over head_dim on queries and keys before RoPE (Qwen3, Gemma 3)
    post_norms=False,  # a norm on each sub-block's output before the residual add (Gemma 2/3)
    embed_scale=False,  # embeddings times sqrt(d_model) (Gemma)
    attn_scale=0.0,  # attention logits times this; 0: head_dim ** -0.5
    attn_softcap=0.0,  # attention logits -> cap * tanh(logits / cap); 0: off (Gemma 2)
    final_softcap=0.0,  # the same on the output logits (Gemma 2)
    sliding_window=0,  # keys seen by a "local" layer: this many positions back, itself included
    layer_types=(),  # per layer "global" or "local" (sliding window); empty: all global
    rope_local_theta=0.0,  # RoPE base of local layers, never scaled; 0: rope_theta (Gemma 3: 1e4)
    rope_scaling="none",  # linear | llama3 | yarn: the frequencies of long-context checkpoints
    rope_factor=1.0,
    rope_low_freq_factor=1.0,  # llama3
    rope_high_freq_factor=4.0,  # llama3
    rope_original_max_len=8192,  # llama3, yarn
    rope_beta_fast=32.0,  # yarn
    rope_beta_slow=1.0,  # yarn
    rope_attention_factor=0.0,  # yarn: cos/sin times this; 0: 0.1 ln(factor) + 1
    rope_truncate=True,  # yarn: correction range rounded to whole dims
)
LAYER_TYPES = ("global", "local")

# Mixture of experts (lm.model.moe): with n_experts > 0 every block's MLP is n_experts SwiGLU
# experts of width expert_d_ff, of which a router picks experts_per_token for each token.
MOE = dict(
    n_experts=0,  # 0: a dense MLP
    experts_per_token=2,
    expert_d_ff=0,  # 0: d_ff
    shared_d_ff=0,  # a dense SwiGLU every token also takes (DeepSeek's shared experts); 0: none
    router_score="softmax",  # softmax (Mixtral, Qwen3-MoE) | sigmoid (DeepSeek-V3) of the router logits
    router_norm=True,  # the chosen experts' weights renormalised to sum to 1
    capacity_factor=0.0,  # 0: dropless; > 0: an expert takes at most this x its even share, the rest dropped
    moe_balance_coef=0.01,  # load-balancing loss (Switch: n_experts * sum_e tokens_share_e * mean_prob_e)
    moe_z_coef=0.001,  # router z-loss (mean logsumexp(router logits)^2)
)

# Pipeline parallelism (lm.model.pipeline), active when mesh.stage > 1: the scanned layers split
# into that many stages, each batch into micro-batches that flow through them.
PIPELINE = dict(
    pipeline_microbatches=0,  # 0: as many as stages
    pipeline_repeats=1,  # 1: GPipe; r > 1: circular, each stage holds r chunks of layers
    # gpipe: all forwards, then all backwards (circular with repeats > 1); 1f1b: one forward, one
    # backward (interleaved 1F1B with repeats > 1), at most `stages` micro-batches held per stage
    pipeline_schedule="gpipe",
)

# head_dim 0: d_model // n_heads. LoRA (lm.model.lora): rank 0 = off; targets among LORA_TARGETS;
# lora_base_quant: how the frozen base's layer weights are held (QLoRA: nf4 | int4, lm.model.quant).
DEFAULTS = dict(
    vocab_size=320,
    d_model=128,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    head_dim=0,
    d_ff=384,
    mlp="swiglu",
    norm="rmsnorm",
    use_bias=False,
    position="rope",
    max_seq_len=256,
    rope_theta=10000.0,
    norm_eps=1e-5,
    tie_embeddings=True,
    compute_dtype="float32",
    attention="auto",
    # with mesh.context > 1 (the sequence split, lm.model.ring_attention): "allgather" gathers the
    # keys and values over `context`; "ring" passes their blocks round it (load-balanced causal chunks)
    context_attention="allgather",
    remat="none",
    init_std=0.02,
    kernels="auto",
    # the blocks' projections (q/k/v/o, the MLP's) as float8 products with per-tensor current
    # scaling: e4m3 operands forward, e5m2 gradients backward (lm.model.fp8, docs/fp8.md); the
    # embeddings, norms, head, router, LoRA adapters and optimizer stay as they are
    fp8=False,
    # "current": each scale from its tensor's own amax this step; "delayed": from the largest amax of
    # the last fp8_history steps (Transformer Engine's recipe), histories kept in the params
    fp8_scaling="current",
    fp8_history=16,
    lora_rank=0,
    lora_alpha=16.0,
    lora_dropout=0.0,
    lora_targets=LORA_TARGETS,
    lora_base_quant="none",
    **ARCHITECTURE,
    **MOE,
    **PIPELINE,
)

CHOICES = dict(
    mlp=("swiglu", "geglu", "gelu"),
    rope_scaling=("none", "linear", "llama3", "yarn"),
    norm=("rmsnorm", "layernorm"),
    position=("rope", "learned"),
    compute_dtype=("float32", "bfloat16"),
    # "auto": the backend's fused kernel (splash on TPU, Pallas flash on GPU), blockwise on CPU
    # (lm.model.fused_attention); "splash"/"flash" on CPU run in Pallas's interpreter (for tests)
    attention=("auto", "splash", "flash", "blockwise", "xla", "cudnn", "reference"),
    context_attention=("allgather", "ring"),
    remat=("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable"),
    # "cpu": lm.model.cpu_kernels (hand-written backward passes for XLA:CPU); "plain": einsum +
    # autodiff, which XLA fuses on GPU/TPU; "auto": cpu on the CPU backend, plain elsewhere
    kernels=("auto", "cpu", "plain"),
    router_score=("softmax", "sigmoid"),
    lora_base_quant=("none", "nf4", "int4"),
    pipeline_schedule=("gpipe", "1f1b"),
    fp8_scaling=("current", "delayed"),
)


def expert_d_ff(m) -> int:
    """Each expert's hidden width; 0 in the config means d_ff."""
    return m.expert_d_ff or m.d_ff


def head_dim(m) -> int:
    """Per-head width; 0 in the config means derive it as d_model // n_heads."""
    return m.head_dim or m.d_model // m.n_heads


def check(c) -> None:
    m = c.model
    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len"):
        require(m[key] > 0, f"model.{key}", m[key], "expected a positive integer")
    for key in ("head_dim", "sliding_window"):
        require(m[key] >= 0, f"model.{key}", m[key], "expected >= 0 (0 = derived / off)")
    require(
        m.head_dim > 0 or m.d_model % m.n_heads == 0,
        "model.n_heads",
        m.n_heads,
        f"must divide model.d_model={m.d_model} (or set model.head_dim)",
    )
    require(m.lora_rank >= 0, "model.lora_rank", m.lora_rank, "expected >= 0 (0 = no adapters)")
    require(m.lora_alpha > 0, "model.lora_alpha", m.lora_alpha, "expected > 0")
    require(0.0 <= m.lora_dropout < 1.0, "model.lora_dropout", m.lora_dropout, "expected a rate in [0, 1)")
    require(
        set(m.lora_targets) <= set(LORA_TARGETS) and m.lora_targets,
        "model.lora_targets",
        m.lora_targets,
        f"expected names among {LORA_TARGETS}",
    )
    require(
        m.lora_base_quant == "none" or m.lora_rank > 0,
        "model.lora_base_quant",
        m.lora_base_quant,
        "quantizes the frozen base of a LoRA run: set model.lora_rank > 0 too",
    )
    require(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads", m.n_kv_heads, f"must divide model.n_heads={m.n_heads}")
    require(
        set(m.layer_types) <= set(LAYER_TYPES) and len(m.layer_types) in (0, m.n_layers),
        "model.layer_types",
        m.layer_types,
        f"expected {m.n_layers} names among {LAYER_TYPES}, or none (all global)",
    )
    require(
        "local" not in m.layer_types or m.sliding_window > 0,
        "model.sliding_window",
        m.sliding_window,
        "expected > 0: model.layer_types has local layers",
    )
    require(
        m.rope_scaling == "none" or m.rope_factor >= 1.0,
        "model.rope_factor",
        m.rope_factor,
        "expected >= 1 with model.rope_scaling",
    )
    require(
        m.position != "rope" or head_dim(m) % 2 == 0, "model.head_dim", head_dim(m), "RoPE needs an even head dimension"
    )
    require(
        m.attention != "cudnn" or m.compute_dtype == "bfloat16",
        "model.attention",
        m.attention,
        "cuDNN's fused attention takes bfloat16 only: set model.compute_dtype=bfloat16 (or another attention)",
    )
    if m.n_experts:
        require(
            0 < m.experts_per_token <= m.n_experts,
            "model.experts_per_token",
            m.experts_per_token,
            f"expected 1 to model.n_experts={m.n_experts}",
        )
        require(m.mlp == "swiglu", "model.mlp", m.mlp, "mixture-of-experts layers are SwiGLU experts")
        adapted = set(m.lora_targets) & {"w_gate", "w_up", "w_down", "w_in"}
        require(
            not (m.lora_rank and adapted),
            "model.lora_targets",
            m.lora_targets,
            "LoRA adapters on expert weights are not supported: with model.n_experts > 0 name only "
            "attention projections (wq, wk, wv, wo)",
        )
    for key in ("n_experts", "expert_d_ff", "shared_d_ff", "pipeline_microbatches"):
        require(m[key] >= 0, f"model.{key}", m[key], "expected >= 0 (0 = off / derived)")
    for key in ("capacity_factor", "moe_balance_coef", "moe_z_coef"):
        require(m[key] >= 0, f"model.{key}", m[key], "expected >= 0")
    require(m.pipeline_repeats >= 1, "model.pipeline_repeats", m.pipeline_repeats, "expected >= 1 (1 = GPipe)")
    check_fp8(c)
    check_pipeline(c)
    check_context(c)


def check_fp8(c) -> None:
    """Delayed scaling's amax histories are params that the update routine shifts (lm.train.steps):
    they must train (not a LoRA run's frozen base) and see each micro-batch once (not a pipeline's
    loop, whose autodiff sums them)."""
    m = c.model
    require(m.fp8_history >= 1, "model.fp8_history", m.fp8_history, "expected >= 1 (steps of amax kept)")
    if not (m.fp8 and m.fp8_scaling == "delayed"):
        return
    require(
        not m.lora_rank,
        "model.fp8_scaling",
        m.fp8_scaling,
        "delayed scaling trains its amax histories with the params; under LoRA (model.lora_rank > 0) they are "
        "frozen: use model.fp8_scaling=current",
    )
    require(
        c.mesh.stage == 1,
        "model.fp8_scaling",
        m.fp8_scaling,
        f"delayed scaling does not run in a pipeline (mesh.stage={c.mesh.stage}): use model.fp8_scaling=current",
    )


def check_context(c) -> None:
    """The sequence must split evenly over mesh.context: into context chunks, or 2 x context for
    the ring's load-balanced halves (a context of -1 is checked once the devices are known)."""
    parts = c.mesh.context * (2 if c.model.context_attention == "ring" else 1)
    if c.mesh.context > 1:
        require(
            c.data.seq_len % parts == 0,
            "mesh.context",
            c.mesh.context,
            f"data.seq_len={c.data.seq_len} must split into {parts} equal chunks"
            + (" (model.context_attention=ring splits it into 2 x mesh.context)" if parts > c.mesh.context else ""),
        )


def check_pipeline(c) -> None:
    """The pipeline against the mesh section (lm.model.pipeline checks the batch when it runs,
    and a stage of -1 once the devices are known)."""
    m, stages = c.model, c.mesh.stage
    if stages <= 1:
        return
    require(
        not m.n_experts,
        "model.n_experts",
        m.n_experts,
        f"mixture-of-experts layers cannot be pipelined yet: set mesh.stage=1 (it is {stages})",
    )
    require(
        m.n_layers % (stages * m.pipeline_repeats) == 0,
        "model.n_layers",
        m.n_layers,
        f"must split into mesh.stage={stages} x model.pipeline_repeats={m.pipeline_repeats} equal chunks",
    )
    require(
        m.pipeline_repeats == 1 or (m.pipeline_microbatches or stages) >= stages,
        "model.pipeline_microbatches",
        m.pipeline_microbatches,
        f"a circular pipeline (model.pipeline_repeats > 1) needs at least mesh.stage={stages} micro-batches",
    )
    interleaved = m.pipeline_schedule == "1f1b" and m.pipeline_repeats > 1
    require(
        not interleaved or (m.pipeline_microbatches or stages) % stages == 0,
        "model.pipeline_microbatches",
        m.pipeline_microbatches,
        f"interleaved 1F1B (model.pipeline_repeats > 1) sends micro-batches round in groups of "
        f"mesh.stage={stages}: expected a multiple of it",
    )
