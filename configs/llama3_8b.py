"""Llama-3-8B shapes (32 layers, width 4096, 32 heads / 8 KV heads, SwiGLU 14336, RoPE θ=500k).

For accelerators: bfloat16 matmuls, full remat, params/optimizer state sharded over fsdp.

Attention is the default "auto": splash attention on TPU, Pallas's flash attention on GPU (both
fused and honouring packed documents; lm.model.fused_attention).
"""

from lm.config import base_config


def get_config():
    c = base_config()
    c.model.update(
        vocab_size=128256,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        d_ff=14336,
        rope_theta=500000.0,
        max_seq_len=8192,
        norm_eps=1e-5,
        tie_embeddings=False,
        compute_dtype="bfloat16",
        remat="full",
    )
    c.data.update(seq_len=8192)
    c.optim.update(lr=3e-4, warmup_steps=2000, min_lr_ratio=0.1, weight_decay=0.1, grad_clip=1.0)
    c.train.update(steps=100000, batch_size=512, micro_batches=1, log_every=10)
    c.eval.update(every_steps=1000, batches=50, batch_size=64)
    c.checkpoint.update(every_steps=500, keep=3)
    c.mesh.update(data=1, fsdp=-1, tensor=1)
    return c
