"""Long-context continued pretraining of a Llama-3-8B base at 131,072 tokens (docs/long-context.md).

The base's 8,192 positions are extended with Llama 3.1's RoPE scaling (`llama3`, factor 8 over the
original 8,192), the sequence split over `mesh.context` (lm.model.ring_attention), the heads over
`tensor`, and every param and Adam moment over `tensor` alone. Rows are packed documents
(segment ids keep them apart), one row of 131,072 tokens per micro-batch.

Start it from the base with `--config.train.init=DIR --config.data.tokenizer=DIR` (or `--init DIR`
with this model section's keys given again as `--config.model.*` overrides: `--init` takes the
checkpoint's model section otherwise: 8,192 positions, no RoPE scaling).
On a v5p-64 (32 chips: context 4 x tensor 8, ring attention) the TPU compiler puts its step at
63.95 GiB a chip (the planner: 64.1). `model.context_attention=allgather` needs a v5p-256 (context
16: 56.9 GiB); without context, splash attention fits a v5p-64 too: `--config.mesh.fsdp=4
--config.mesh.context=1 --config.train.micro_batches=2` (78.4 GiB). docs/long-context.md has the table.
"""

import pathlib

from lm.config import load_file

SEQ = 131072


def get_config():
    c = load_file(str(pathlib.Path(__file__).with_name("llama3_8b.py")))
    c.model.update(
        max_seq_len=SEQ,
        rope_scaling="llama3",
        rope_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_len=8192,
        remat="full",
        context_attention="ring",
    )
    c.data.update(seq_len=SEQ)
    # a small rate with a short warmup: the base is trained, only the long positions are new
    c.optim.update(lr=2e-5, warmup_steps=50, min_lr_ratio=0.1, weight_decay=0.1, grad_clip=1.0)
    # 8 rows of 131,072 tokens (1M tokens) a step, one row per micro-batch; 5,000 steps: 5.2B tokens
    c.train.update(steps=5000, batch_size=8, micro_batches=8, log_every=1)
    c.eval.update(every_steps=250, batches=4, batch_size=8)
    # a step of 1M tokens takes seconds to tens of seconds: lose at most 100 steps or 30 minutes
    c.checkpoint.update(every_steps=100, every_minutes=30.0, keep=3)
    c.mesh.update(data=1, fsdp=1, context=4, tensor=8)  # 32 chips: a v5p-64
    return c
