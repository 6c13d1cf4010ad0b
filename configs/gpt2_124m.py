"""GPT-2 small (124M): learned positions, LayerNorm with biases, GELU MLP, tied head.

Shapes as published (vocab 50257, 12 layers, 12 heads, width 768, context 1024).
With the byte tokenizer only the first 259 ids are used; a GPT-2 BPE vocabulary comes
with the tokenizer stage.
"""

from lm.config import base_config


def get_config():
    c = base_config()
    c.model.update(
        vocab_size=50257,
        d_model=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=12,
        d_ff=3072,
        mlp="gelu",
        norm="layernorm",
        use_bias=True,
        position="learned",
        max_seq_len=1024,
        tie_embeddings=True,
        remat="dots_saveable",
    )
    c.data.update(seq_len=1024)
    c.optim.update(lr=6e-4, warmup_steps=700, weight_decay=0.1, b2=0.95, grad_clip=1.0)
    c.train.update(steps=20000, batch_size=512, micro_batches=8, log_every=20)
    c.eval.update(every_steps=500, batches=20, batch_size=32)
    c.checkpoint.update(every_steps=1000, keep=3)
    c.mesh.update(data=-1, fsdp=1, tensor=1)
    return c
