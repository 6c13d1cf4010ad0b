"""Completions of many prompts for evaluation: through the engine (continuous batching, `batch_size`
requests decoded together), cut at stop strings. Generation tasks, held-out exact match and the
lm-evaluation-harness adapter use it."""

from __future__ import annotations

from lm.infer.engine.engine import EngineConfig
from lm.infer.generate import Generator, generation_context
from lm.infer.sampling import SamplingParams
from lm.infer.text import complete_ids


def completions(
    model,
    params,
    tokenizer,
    prompts: list,
    *,
    max_new_tokens: int,
    stop: tuple[str, ...] = (),
    eos_ids: tuple[int, ...] | None = None,
    mesh=None,
    rules=(),
    batch_size: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[dict]:
    """{'text', 'ids', 'finish_reason', 'prompt_cut'} per prompt (token ids). A prompt that leaves
    fewer than max_new_tokens positions in the model's context loses its oldest tokens
    (prompt_cut counts them); greedy unless temperature > 0."""
    max_len = generation_context(model.spec)
    new = max(1, min(max_new_tokens, max_len - 1))
    sampling = SamplingParams(max_new_tokens=new, temperature=temperature, seed=seed)
    config = EngineConfig(slots=max(1, min(batch_size, len(prompts))))
    generator = Generator(
        model, params, sampling, eos_id=eos_ids or (tokenizer.eos_id,), mesh=mesh, rules=rules, config=config
    )
    batch = [[int(t) for t in p] for p in prompts]
    cuts = [max(0, len(p) - (max_len - new)) for p in batch]
    done = complete_ids(generator, tokenizer, [p[c:] for p, c in zip(batch, cuts)], stop=tuple(stop))
    return [r | {"prompt_cut": c} for r, c in zip(done, cuts)]
