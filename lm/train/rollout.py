"""RL rollouts: sample responses with the KV-cache sampler, score them, and lay them out as
update rows (the text contract plus per-token fields, see lm.train.rl_losses).

A row is the prompt followed by its sampled response, right-padded to data.seq_len; the loss
mask covers the response tokens (its end marker included when the sampler stopped there).
`old_logp` holds the log-probs of those tokens, aligned with `targets`, under the distribution
they were sampled from, log softmax(logits / rl.temperature) (top-p's cut left out, as TRL): at
temperature 1 the sampler's own (lm.infer.sampling reports the untempered distribution's), at
any other the scoring pass recomputes them from the same params. The reference's log-probs are
taken at the same temperature, so the KL compares like with like.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from lm.infer.engine.engine import EngineConfig
from lm.infer.generate import Generation, Generator
from lm.infer.sampling import SamplingParams
from lm.model.apply import logits_of
from lm.model.layers import Partitioning
from lm.model.lora import merge_lora
from lm.model.params import merge_trees
from lm.model.transformer import abstract_params
from lm.sharding import param_shardings
from lm.train.rl_losses import tempered_logprobs

SCORE_FIELDS = ("inputs", "targets", "loss_mask", "segment_ids", "positions")
_copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


@dataclasses.dataclass
class Rollouts:
    rows: dict  # numpy [B, T] fields: the text contract + old_logp
    responses: list[np.ndarray]  # each row's sampled ids
    finish: list[str]  # 'eos' | 'length' per row

    @property
    def truncated(self) -> np.ndarray:
        return np.array([f == "length" for f in self.finish])

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(r) for r in self.responses], np.int32)


def layout(prompts: list[list[int]], generation: Generation, seq_len: int) -> Rollouts:
    """Rows of prompt + response ids with the response masked in and its log-probs aligned."""
    b = len(prompts)
    rows = {k: np.zeros((b, seq_len), np.int32) for k in ("inputs", "targets", "segment_ids", "positions")}
    rows["loss_mask"] = np.zeros((b, seq_len), np.float32)
    rows["old_logp"] = np.zeros((b, seq_len), np.float32)
    for i, (p, r, lp) in enumerate(zip(prompts, generation.ids, generation.logprobs)):
        tokens = np.concatenate([np.asarray(p, np.int32), np.asarray(r, np.int32)])[: seq_len + 1]
        n = len(tokens) - 1  # inputs hold all but the last token
        rows["inputs"][i, :n], rows["targets"][i, :n] = tokens[:-1], tokens[1:]
        rows["segment_ids"][i, :n], rows["positions"][i, :n] = 1, np.arange(n)
        start = len(p) - 1  # the target at position len(p) - 1 is the first response token
        k = min(len(r), n - start)
        rows["loss_mask"][i, start : start + k] = 1.0
        rows["old_logp"][i, start : start + k] = np.asarray(lp[:k], np.float32)
    return Rollouts(rows, list(generation.ids), list(generation.finish))


class Sampler:
    """The policy's responses to prompts: the generating model is the plain decoder (adapters
    folded in, no value head) over the current params, on the run's mesh or on a mesh of its own
    (`mesh`: other devices, rl.generation_devices), where `params` copies the policy across."""

    def __init__(self, run, sampling: SamplingParams, eos_id, seq_len: int, speculate: int = 0, mesh=None):
        spec = run.model.spec.without_lora()
        self.speculate = speculate  # prompt-lookup drafts per row and step (lm.infer.engine.spec_steps; 0: off)
        self.own_mesh = mesh is not None
        self.mesh, self.rules = mesh or run.mesh, run.rules
        self.model = run.model.clone(spec=spec, scalar_head=False, part=Partitioning(self.mesh, run.rules))
        self.run, self.sampling, self.eos_id, self.seq_len = run, sampling, eos_id, seq_len
        self._logprobs = None
        self._placement = param_shardings(abstract_params(self.model), self.mesh, run.rules) if mesh else None
        m = run.config.model
        lora, alpha, rank = m.lora_rank > 0, m.lora_alpha, m.lora_rank

        def policy(params, frozen):
            p = merge_trees(params, (frozen or {}).get("base"))
            p = {k: v for k, v in p.items() if k != "scalar_head"}
            return merge_lora(p, alpha, rank) if lora else p

        self._policy = jax.jit(policy)

    def params(self, state_params, frozen):
        """The policy's params where generation reads them (on its own mesh: a copy)."""
        policy = self._policy(state_params, frozen)
        return policy if self._placement is None else jax.device_put(policy, self._placement)

    def logprobs(self, params, rows: dict, temperature: float) -> np.ndarray:
        """The sampled tokens' log-probs under `params` at `temperature` (the engine reports the
        untempered ones), on the generation mesh; zero outside the loss mask."""
        if self._logprobs is None:
            model, t = self.model, temperature
            self._logprobs = jax.jit(lambda p, r: tempered_logprobs(logits_of(model, p, r), r["targets"], t))
        placed = jax.device_put(
            {k: rows[k] for k in SCORE_FIELDS if k != "loss_mask"}, NamedSharding(self.mesh, PartitionSpec())
        )
        return np.asarray(jax.device_get(self._logprobs(params, placed)), np.float32) * rows["loss_mask"]

    def snapshot(self, params):
        """Params the update cannot overwrite (it donates its own): on the run's mesh, a copy."""
        return params if self.own_mesh else _copy(params)

    def __call__(self, params, prompts: list[list[int]], rng, sampling: SamplingParams | None = None) -> Generation:
        generator = Generator(
            self.model,
            params,
            sampling or self.sampling,
            eos_id=self.eos_id,
            max_len=self.seq_len,
            mesh=self.mesh,
            rules=self.rules,
            config=EngineConfig(slots=len(prompts), speculate=self.speculate) if self.speculate else None,
        )
        return generator(prompts, rng=rng)


class Scorer:
    """One jitted pass over rollout rows for what stays fixed during the updates: the
    reference's per-token log-probs (when the KL needs them), PPO's value estimates and, at an
    rl.temperature other than 1, the policy's own log-probs at that temperature (`old_logp`: the
    sampler reports the untempered ones). Log-probs are at rl.temperature (lm.train.rl_losses)."""

    def __init__(self, run, with_values: bool, with_policy: bool = False):
        self.temperature = run.config.rl.temperature
        self.with_reference, self.with_values = "reference" in run.frozen, with_values
        # the policy's own log-probs: at a temperature other than 1, or asked for (stale rollouts' proximal policy)
        self.with_policy = with_policy = with_policy or self.temperature != 1.0
        model, rep, t = run.model, NamedSharding(run.mesh, PartitionSpec()), self.temperature
        reference = run.frozen["reference"].built.module if self.with_reference else None

        def score(params, frozen, rows):
            out, full = {}, merge_trees(params, frozen.get("base"))
            if reference is not None:
                out["ref_logp"] = tempered_logprobs(logits_of(reference, frozen["reference"], rows), rows["targets"], t)
            if with_policy and with_values:
                logits, out["old_values"] = logits_of(model, full, rows, output="logits_and_scalar")
            elif with_values:
                out["old_values"] = logits_of(model, full, rows, output="scalar")
            elif with_policy:
                logits = logits_of(model, full, rows)
            if with_policy:
                out["old_logp"] = tempered_logprobs(logits, rows["targets"], t)
            return out

        self._score = jax.jit(score, out_shardings=rep)
        self.run = run

    @property
    def active(self) -> bool:
        return self.with_reference or self.with_values or self.with_policy

    def __call__(self, params, frozen, rows: dict, placer) -> dict:
        if not self.active:
            return {}
        placed = placer.from_global({k: rows[k] for k in SCORE_FIELDS})
        out = jax.device_get(self._score(params, frozen or {}, placed))
        return {k: np.asarray(v, np.float32) * rows["loss_mask"] for k, v in out.items()}
