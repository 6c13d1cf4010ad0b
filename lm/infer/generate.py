"""Generating for a list of prompts: every prompt becomes a request of the engine (lm.infer.engine),
which decodes them with continuous batching over a paged KV cache on the model's mesh.

Per request: the new tokens (an end id included when it stopped there), their log-probs under the
model and why it stopped. Each request draws with its own key (the run's key folded with its index),
so a prompt's tokens do not depend on the others in the list, and repeated prompts (RL groups) get
different samples.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np

from lm.errors import UserError
from lm.infer.engine.engine import Engine, EngineConfig, Request, check_prompt
from lm.infer.sampling import SamplingParams

# The most positions one generation allocates a KV cache for: a long-context checkpoint's whole
# window (128k positions for Llama 3.1) would otherwise be reserved for every request.
MAX_CACHE = 4096


def generation_context(spec) -> int:
    """Positions a prompt and its new tokens may take: the model's context, at most MAX_CACHE."""
    return min(spec.max_seq_len, MAX_CACHE)


@dataclasses.dataclass
class Generation:
    """Per prompt: the new tokens (the end id included when it stopped there), their log-probs under
    the model, and why it stopped ('eos', 'length', 'stop' or 'cancelled')."""

    ids: list[np.ndarray]
    logprobs: list[np.ndarray]
    finish: list[str]


class Generator:
    """Generation for one model and sampling setting, on a mesh (`mesh=`, `rules=`) or one device.

    max_len: the positions a prompt and its new tokens may take (default and upper bound: the
    model's context, see `generation_context`). config: the engine's slots, pages and blocks
    (default: one slot per prompt, pages for every slot's whole context). draft: a draft model
    proposing `config.speculate` tokens per row and step (params: a (target, draft) pair);
    `drafted` sums what speculation proposed, kept and verified over every call.
    """

    def __init__(
        self,
        model,
        params,
        sampling: SamplingParams,
        *,
        eos_id: int | tuple[int, ...],
        max_len: int | None = None,
        mesh=None,
        rules=(),
        unstack: bool | None = None,
        config: EngineConfig | None = None,
        draft=None,
    ):
        self.eos_id = tuple(int(i) for i in eos_id) if isinstance(eos_id, (tuple, list)) else (int(eos_id),)
        self.model, self.params, self.sampling = model, params, sampling
        self.max_len = max_len or generation_context(model.spec)
        if self.max_len > model.spec.max_seq_len:
            raise UserError(
                f"generation: max_len {self.max_len} exceeds the model's context ({model.spec.max_seq_len} positions)"
            )
        self.mesh, self.rules, self.unstack, self.config = mesh, rules, unstack, config
        self.draft = draft
        self.drafted = dict(proposed=0, accepted=0, passes=0)

    def engine(self, n_prompts: int) -> Engine:
        config = self.config or EngineConfig(slots=max(1, n_prompts))
        return Engine(
            self.model,
            max_len=self.max_len,
            config=config,
            mesh=self.mesh,
            rules=self.rules,
            unstack=self.unstack,
            draft=self.draft,
        )

    def check(self, prompts: list) -> None:
        for i, p in enumerate(prompts):
            check_prompt(self.max_len, p, self.sampling, f"prompt {i}")

    def __call__(
        self,
        prompts: list,
        rng=None,
        on_tokens: list[Callable] | None = None,
        samplings: list[SamplingParams] | None = None,
    ) -> Generation:
        """prompts: token id lists. rng: the run's key (default: from sampling.seed; RL passes a
        fresh one per step). on_tokens: per prompt, called with each piece of new ids and log-probs;
        returning True stops that prompt ('stop'). samplings: per-prompt settings (default: one)."""
        self.check(prompts)
        base = jax.random.PRNGKey(self.sampling.seed) if rng is None else rng
        keys = np.asarray(jax.vmap(lambda i: jax.random.fold_in(base, i))(np.arange(len(prompts))), np.uint32)
        requests = [
            Request(
                [int(t) for t in p],
                (samplings or [self.sampling] * len(prompts))[i],
                self.eos_id,
                key=keys[i],
                on_tokens=on_tokens[i] if on_tokens else None,
            )
            for i, p in enumerate(prompts)
        ]
        engine = self.engine(len(prompts))
        engine.run(self.params, requests)
        proposed, accepted = engine.acceptance
        for name, n in (("proposed", proposed), ("accepted", accepted), ("passes", engine.verify_passes)):
            self.drafted[name] += n
        return Generation(
            [np.asarray(r.ids, np.int32) for r in requests],
            [np.asarray(r.logps, np.float32) for r in requests],
            [r.finish for r in requests],
        )
