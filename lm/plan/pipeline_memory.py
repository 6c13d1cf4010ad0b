"""The planner's view of a pipelined step (lm.model.pipeline, lm.model.pipeline_1f1b): its schedule,
bubble and what a stage holds beside the layers' saved inputs (lm.plan.memory counts those)."""

from __future__ import annotations

import dataclasses
import functools

from lm.model import pipeline
from lm.model.pipeline_schedule import simulate
from lm.model.spec import ModelSpec
from lm.train.registry import compiled_step

# Pipeline, fitted to compiles of pipelined configs (small ones and Llama-3-70B): float32 copies of
# a stage's block params (the gradients' accumulator in the pipeline's view), copies of the
# micro-batches' store, and float32 streams of all the rows in the backward of the final norm and
# head. A circular schedule picks the chunk each stage runs inside the loop, and the compiler kept
# that float32 chunk for every iteration (Llama-3-70B; a small config kept far less).
STAGE_PARAM_COPIES = 1.0
PIPELINE_STORES = 2.0
HEAD_STREAMS = 4.0


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """The schedule a pipelined step runs (lm.model.pipeline, lm.model.pipeline_schedule)."""

    stages: int
    microbatches: int
    repeats: int
    schedule: str = "gpipe"

    @property
    def name(self) -> str:
        if self.schedule == "1f1b":
            return "1F1B" if self.repeats == 1 else f"interleaved 1F1B, {self.repeats} virtual stages"
        return "GPipe" if self.repeats == 1 else f"circular, {self.repeats} repeats"

    @property
    def iterations(self) -> int:
        return self.microbatches * self.repeats + self.stages - 1

    @property
    def bubble(self) -> float:
        return pipeline.bubble_fraction(self.stages, self.microbatches, self.repeats)

    @property
    def held(self) -> int:
        """1F1B: the stage inputs a stage keeps at its peak, from the schedule's table (at most
        `stages` micro-batches without virtual stages)."""
        return _table(self.stages, self.microbatches, self.repeats).x_slots

    @property
    def gradients_held(self) -> int:
        return _table(self.stages, self.microbatches, self.repeats).g_slots


@functools.cache
def _table(stages: int, microbatches: int, repeats: int):
    return simulate("1f1b", stages, microbatches, repeats)


def pipeline_of(config, step: str, mesh: dict) -> Pipeline | None:
    """The pipeline of a step on this mesh (mesh.stage > 1; decoding runs the plain layer scan)."""
    stages = mesh["stage"]
    if stages == 1 or compiled_step(step).generation:
        return None
    spec = ModelSpec.from_config(config.model)
    return Pipeline(stages, pipeline.microbatches(spec, stages), spec.pipeline.repeats, spec.pipeline.schedule)


def pipeline_parts(pipe: Pipeline, spec: ModelSpec, blocks: int, r, rows, length, embed, c) -> dict:
    """What a pipelined step holds beside the layers' saved inputs: the stage's block params in the
    pipeline's view (float32: their gradients' accumulator; for a circular schedule, the chunk
    each iteration runs), the backward of the final norm and head over all the rows (float32
    streams), the micro-batches' store, and the RoPE tables each iteration saves (cos and sin,
    float32). blocks: the stage's block params' float32 bytes on a device; r: rows per device, rows:
    per pipeline micro-batch."""
    parts = {"stage params": int(STAGE_PARAM_COPIES * blocks)}
    if pipe.repeats > 1 and pipe.schedule != "1f1b":  # the chunk each iteration picks, kept for the backward
        parts["circular chunks"] = int(pipe.iterations * blocks / pipe.repeats)
    if pipe.schedule == "1f1b":  # the loss runs per micro-batch; stage inputs and gradients wait in buffers
        parts["loop gradients"] = int(blocks)  # the custom VJP's copy beside the loop's accumulator
        parts["final backward"] = int(HEAD_STREAMS * rows * length * embed * 4)
        parts["in-flight inputs"] = int((pipe.held + pipe.gradients_held) * rows * length * embed * c)
    else:
        parts["final backward"] = int(HEAD_STREAMS * r * length * embed * 4)
    parts["pipeline store"] = int(PIPELINE_STORES * r * length * embed * c)
    if spec.position == "rope":
        tables = 1 if pipe.schedule == "1f1b" else pipe.iterations / pipe.microbatches  # every micro-batch's, once
        parts["saved residuals"] = int(tables * pipe.microbatches * 2 * rows * length * spec.attention.head_dim * 4)
    return parts
