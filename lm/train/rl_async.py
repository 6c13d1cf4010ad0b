"""Asynchronous rollouts for `lm rl` (rl.max_staleness = k > 0): the rollouts of step s + k are
sampled with the params of step s while step s updates, so sampling and the update overlap.

Step s trains on rollouts sampled with the params of step max(0, s - k): a fixed lag, so a run
is the same whatever the timing of the two threads, and k = 0 is the synchronous run (the RL
step then takes none of this path). At step s the pipeline launches every step in s..s+k not
yet launched (k + 1 at the first step, then one a step) on a worker thread, with a copy of the
params (the update donates its own; with rl.generation_devices the copy on the generation
devices), then waits for step s's. The last k steps' launches sample
for steps past the run's end: a run extended later (more train.steps, --resume) trains on them,
as an uninterrupted longer run would. With several processes the
rollouts are sampled in turn on the main thread instead (two threads issuing collectives could
interleave differently on each process): the same rollouts, no overlap.

The prompt batches of the steps ahead are read ahead of the loop (`Lookahead`), and a checkpoint
holds, beside the prompt stream's position as the loop saw it, the rollouts already sampled for
the steps after it (waited for, then saved as arrays): a resumed run trains on exactly what the
uninterrupted one would have. The loss corrects for the older policy with importance weights
(lm.train.rl_losses, `is_weight`; computed in lm.train.rl_step).
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import io
import json

import jax
import numpy as np

from lm.train.rollout import Rollouts


@dataclasses.dataclass
class Rollout:
    """One step's scored rollouts and the params version (step) that sampled them."""

    ro: Rollouts
    total: np.ndarray
    parts: dict
    counts: dict
    seconds: float
    version: int
    errors: dict = dataclasses.field(default_factory=dict)  # why the failed rewards failed, by source


class Pipeline:
    """Rollouts of the steps ahead: `produce(params, batch, step) -> Rollout`."""

    def __init__(self, produce, k: int, snapshot, overlap: bool | None = None):
        self.produce, self.k, self.snapshot = produce, k, snapshot  # snapshot: params the update cannot overwrite
        self.overlap = jax.process_count() == 1 if overlap is None else overlap
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollouts") if self.overlap else None
        self.pending: dict[int, concurrent.futures.Future] = {}
        self.ahead = None  # the Lookahead whose batches the steps ahead sample

    def take(self, step: int, batch, params) -> Rollout:
        """Step `step`'s rollouts, after launching those of the steps up to step + k with `params`."""
        todo = [j for j in range(step, step + self.k + 1) if j not in self.pending]
        snapshot = self.snapshot(params) if todo else None
        for j in todo:
            b = batch if j == step else self.ahead.peek(j - step - 1)
            self.pending[j] = self._launch(snapshot, b, j, step)
        return self.pending.pop(step).result()

    def _launch(self, params, batch, step: int, version: int) -> concurrent.futures.Future:
        if self._worker is not None:
            return self._worker.submit(self._produce, params, batch, step, version)
        done = concurrent.futures.Future()
        done.set_result(self._produce(params, batch, step, version))
        return done

    def _produce(self, params, batch, step: int, version: int) -> Rollout:
        return dataclasses.replace(self.produce(params, batch, step), version=version)

    def state(self) -> dict:
        """The rollouts sampled for the steps ahead (waited for), as JSON."""
        return {str(j): _pack(dataclasses.asdict(f.result())) for j, f in sorted(self.pending.items())}

    def restore(self, state: dict) -> None:
        self.pending = {}
        for j, packed in state.items():
            d = _unpack(packed)
            d["ro"] = Rollouts(**d["ro"])
            done = concurrent.futures.Future()
            done.set_result(Rollout(**d))
            self.pending[int(j)] = done


class Lookahead:
    """The prompt stream as the loop reads it (`next`), with the batches after the loop's read
    ahead (`peek`), and a state that is the stream's after the loop's last batch, the
    pipeline's rollouts of the steps ahead (if any) and the failed rewards' count (`failures`:
    lm.train.reward_failures.RewardFailures)."""

    def __init__(self, stream, pipeline: Pipeline | None, failures=None):
        self.stream, self.pipeline, self.failures = stream, pipeline, failures
        if pipeline is not None:
            pipeline.ahead = self
        self._ahead: list = []  # (batch, the stream's state after it)
        self._seen = stream.get_state()

    def __iter__(self):
        return self

    def __next__(self):
        self._fill(1)
        batch, self._seen = self._ahead.pop(0)
        return batch

    def peek(self, j: int):
        """The batch j after the one `next` returned last (0: the next one)."""
        self._fill(j + 1)
        return self._ahead[j][0]

    def _fill(self, n: int) -> None:
        while len(self._ahead) < n:
            batch = next(self.stream)
            self._ahead.append((batch, self.stream.get_state()))

    def get_state(self) -> bytes:
        """JSON bytes (how grain's checkpoint handler saves an iterator that is not its own)."""
        seen = self._seen.decode() if isinstance(self._seen, bytes) else self._seen
        state = {"stream": seen, "rollouts": self.pipeline.state() if self.pipeline else {}}
        return json.dumps(state | ({"failures": self.failures.state()} if self.failures else {})).encode()

    def set_state(self, state) -> None:
        state = json.loads(state) if isinstance(state, (bytes, str)) else state
        if not (isinstance(state, dict) and {"stream", "rollouts"} <= set(state)):
            state = {"stream": state, "rollouts": {}}  # saved by a run whose stream was the prompts' own
        self.stream.set_state(state["stream"])
        self._seen, self._ahead = state["stream"], []
        if self.pipeline is not None:
            self.pipeline.restore(state["rollouts"])
        if self.failures is not None and "failures" in state:
            self.failures.restore(state["failures"])

    def start_prefetch(self) -> None:  # (grain's handler calls it after a restore)
        if hasattr(self.stream, "start_prefetch"):
            self.stream.start_prefetch()


def _pack(x):
    if isinstance(x, np.ndarray):
        buf = io.BytesIO()
        np.save(buf, x, allow_pickle=False)
        return {"__array__": base64.b64encode(buf.getvalue()).decode()}
    if isinstance(x, dict):
        return {k: _pack(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_pack(v) for v in x]
    return x.item() if isinstance(x, np.generic) else x


def _unpack(x):
    if isinstance(x, dict) and "__array__" in x:
        return np.load(io.BytesIO(base64.b64decode(x["__array__"])), allow_pickle=False)
    if isinstance(x, dict):
        return {k: _unpack(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_unpack(v) for v in x]
    return x
