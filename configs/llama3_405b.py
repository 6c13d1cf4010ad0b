"""Llama-3.1-405B shapes (126 layers, width 16384, 128 heads / 8 KV heads, SwiGLU 53248, RoPE θ=500k
with Llama 3.1's long-context frequencies).

For pods (`lm plan --target v5p-512` shows what a step needs there): bfloat16 matmuls, full remat,
fsdp over 32 chips × 8-way tensor parallelism, one row of 8192 tokens per chip in each of
32 micro-batches of the 1024-row batch. The residual stream is split over `tensor` too
(`act_embed`): the 126 layers' saved inputs would otherwise take 31.5 GiB a chip, and the step
would need 98 GiB of a v5p's 95.
"""

from lm.config import base_config


def get_config():
    c = base_config()
    c.model.update(
        vocab_size=128256,
        d_model=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        d_ff=53248,
        rope_theta=500000.0,
        rope_scaling="llama3",
        rope_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_len=8192,
        max_seq_len=131072,
        norm_eps=1e-5,
        tie_embeddings=False,
        compute_dtype="bfloat16",
        remat="full",
    )
    c.data.update(seq_len=8192)
    c.optim.update(lr=8e-5, warmup_steps=8000, min_lr_ratio=0.01, weight_decay=0.1, grad_clip=1.0)
    c.train.update(steps=100000, batch_size=1024, micro_batches=32, log_every=10)
    c.eval.update(every_steps=1000, batches=50, batch_size=256)
    c.checkpoint.update(every_steps=250, keep=3)
    c.mesh.update(data=1, fsdp=-1, tensor=8)
    c.mesh.rules["act_embed"] = ("tensor",)
    return c
