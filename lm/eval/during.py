"""Language-modelling sets scored during training (config eval.sets), beside the held-out loss.

Each set (`NAME=PATH`, any set `lm eval` reads) is tokenized once, cut to eval.set_tokens
tokens, and scored at every eval with the step's params on the run's mesh: the metrics
`eval/<NAME>/loss` and `eval/<NAME>/bits_per_byte` go to the JSONL, TensorBoard and the plot.
They equal `lm eval`'s numbers for the same checkpoint and set.
"""

from __future__ import annotations

from typing import Callable

from lm.config import parse_sets
from lm.eval.loglik import Scorer
from lm.eval.sets import read_set, score_set
from lm.model.params import merge_trees


def with_sets(evaluate: Callable | None, e, built, tokenizer, frozen=None) -> Callable | None:
    """`evaluate` (or nothing) plus the sets of `e` (config.eval) scored with the trained model
    (`built`, lm.model.build); unchanged when there are none."""
    if not e.sets:
        return evaluate
    sets = [(name, read_set(path, tokenizer, e.set_tokens)) for name, path in parse_sets(e.sets)]
    scorer = Scorer(built.module, None, tokenizer, mesh=built.mesh, rules=built.rules, batch_size=e.batch_size)
    base = (frozen or {}).get("base")  # the trained model's frozen part (under LoRA adapters)

    def evaluate_all(state) -> dict:
        out = dict(evaluate(state)) if evaluate else {}
        scorer.params = merge_trees(state.params, base)
        for name, docs in sets:
            m = score_set(scorer, docs)["metrics"]
            out |= {f"eval/{name}/loss": m["loss"], f"eval/{name}/bits_per_byte": m["bits_per_byte"]}
        return out

    return evaluate_all
