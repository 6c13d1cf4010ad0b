"""Tiny byte-level model: trains on the Python standard library on a laptop CPU in minutes."""

from lm.config import base_config


def get_config():
    c = base_config()
    c.model.update(vocab_size=264, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=384,
                   max_seq_len=256, tie_embeddings=True, remat="none")
    c.data.update(seq_len=256, max_train_bytes=0)
    c.optim.update(lr=3e-3, warmup_steps=50, weight_decay=0.1, grad_clip=1.0)
    c.train.update(steps=600, batch_size=16, log_every=10)
    c.eval.update(every_steps=100, batches=8, batch_size=16)
    c.checkpoint.update(every_steps=200, keep=2)
    return c
