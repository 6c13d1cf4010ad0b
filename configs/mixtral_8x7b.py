"""Mixtral-8x7B shapes (32 layers, width 4096, 32 heads / 8 KV heads, vocab 32000, RoPE θ=1e6, untied):
every block's MLP is 8 SwiGLU experts of width 14336, 2 of which each token takes. 46.7B params in
all, 12.9B active per token (`lm plan` prints both).

For pods (`lm plan --config configs/mixtral_8x7b.py --target v5p-64`): bfloat16 matmuls, full
remat, dropless routing (grouped matmuls). Each expert lives on its own slice of the 8-way `expert`
axis, split 4 ways over `tensor` (its hidden units; heads, vocabulary and MLP too); fsdp takes what
a larger slice adds. Rows split over data x fsdp x expert (the rule table): on a v5p-64 (32 chips)
the 512-row batch of 4096 tokens goes through in 32 micro-batches of 2 rows a chip. Dropless
routing gathers the rows of a chip's 8 peers on the expert axis (here the whole micro-batch, 8 x 2 rows
of 4096) and runs their assignments to its own expert, which is what bounds the micro-batch: 68 GiB a
chip there (the TPU compiler's figure).
"""

from lm.config import base_config


def get_config():
    c = base_config()
    c.model.update(
        vocab_size=32000,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        d_ff=14336,
        n_experts=8,
        experts_per_token=2,
        expert_d_ff=14336,
        router_score="softmax",
        router_norm=True,
        capacity_factor=0.0,
        rope_theta=1e6,
        max_seq_len=32768,
        norm_eps=1e-5,
        tie_embeddings=False,
        compute_dtype="bfloat16",
        remat="full",
    )
    c.data.update(seq_len=4096)
    c.optim.update(lr=3e-4, warmup_steps=2000, min_lr_ratio=0.1, weight_decay=0.1, grad_clip=1.0)
    c.train.update(steps=100000, batch_size=512, micro_batches=32, log_every=10)
    c.eval.update(every_steps=1000, batches=50, batch_size=64)
    c.checkpoint.update(every_steps=500, keep=3)
    c.mesh.update(data=1, fsdp=-1, expert=8, tensor=4)
    return c
