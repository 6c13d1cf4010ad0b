"""Llama-3-70B (configs/llama3_70b.py) trained with pipeline parallelism on a v5p-128 (64 chips):
4 GPipe stages of 20 layers x fsdp 2 x tensor 8 (`lm plan --config configs/llama3_70b_pipeline.py
--target v5p-128` prints the per-stage memory and the bubble).

The 1024-row batch of 8192 tokens: 512 rows per fsdp shard, in 32 micro-batches (gradient
accumulation) of 16 rows, each cut into 16 pipeline micro-batches of one row: 19 iterations, a
bubble of 3/19 = 15.8%. The residual stream is split over `tensor` (`act_embed`, as in
configs/llama3_405b.py), so the layers' saved inputs of all 19 iterations take 6 GiB a chip.
The TPU compiler puts the step at 56 GiB of a v5p's 95.

Halving the bubble: `--config.train.micro_batches=16 --config.model.pipeline_microbatches=32`
(8.6%) compiles to 87 GiB a chip, near the HBM; a circular schedule
(`--config.model.pipeline_repeats=2`) compiles to 118 GiB and does not fit. With
`--config.model.pipeline_schedule=1f1b` a stage holds at most 4 micro-batches' inputs: 47.3 GiB,
and 47.2 GiB at the halved bubble; interleaved 1F1B (`... --config.model.pipeline_repeats=2`)
43.3 GiB (docs/moe-and-pipelines.md).
"""

import pathlib

from lm.config import load_file


def get_config():
    c = load_file(str(pathlib.Path(__file__).with_name("llama3_70b.py")))
    c.mesh.update(data=1, stage=4, fsdp=-1, tensor=8)
    c.mesh.rules["act_embed"] = ("tensor",)
    c.model.update(pipeline_microbatches=16, pipeline_repeats=1, remat="full")
    c.train.update(micro_batches=32)
    return c
