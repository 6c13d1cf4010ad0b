"""Multiple choice by log-likelihood (the HellaSwag / MMLU method).

An example is {"context", "choices": [...], "answer": index or the right choice's text}. Each
choice is scored as a continuation of the context (joined by one space); the model's pick is
the choice with the highest summed log-prob (acc) or the highest log-prob per character of the
choice (acc_norm, which does not favour short choices; lm-evaluation-harness's definition). With k
shots, k other examples of the file (drawn with a fixed seed, per example) precede the context,
each with its right answer.
Calibration: the choice probabilities are the softmax of the summed log-probs; the expected
calibration error bins the top choice's probability into 10 equal bins and averages
|accuracy - confidence| weighted by the bin's share of examples.
"""

from __future__ import annotations

import numpy as np

from lm.errors import UserError
from lm.eval.loglik import encode_pair

SHOT_SEPARATOR = "\n\n"
ECE_BINS = 10


def parse_choice(obj: dict, where: str) -> dict:
    """A checked example: {'context', 'choices', 'answer' (index)}."""
    ctx, choices, answer = obj.get("context"), obj.get("choices"), obj.get("answer")
    if (
        not isinstance(ctx, str)
        or not isinstance(choices, list)
        or len(choices) < 2
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise UserError(
            f'{where}: expected {{"context": str, "choices": [two or more non-empty str], "answer": index or choice}}'
        )
    if isinstance(answer, str) and answer in choices:
        answer = choices.index(answer)
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
        raise UserError(
            f"{where}: 'answer' is {answer!r}; expected an index below {len(choices)} or one of the choices"
        )
    return {"context": ctx, "choices": choices, "answer": answer}


def fewshot_prefix(examples: list[dict], i: int, shots: int, seed: int) -> str:
    """`shots` other examples with their answers, the same every run for example i."""
    if shots <= 0:
        return ""
    if shots >= len(examples):
        raise UserError(f"{shots} shots need more than {shots} examples in the task file ({len(examples)})")
    others = [j for j in range(len(examples)) if j != i]
    picked = np.random.default_rng([seed, i]).choice(others, size=shots, replace=False)
    return "".join(_solved(examples[j]) + SHOT_SEPARATOR for j in picked)


def _solved(ex: dict) -> str:
    return f"{ex['context']} {ex['choices'][ex['answer']]}"


def requests(examples: list[dict], tokenizer, shots: int = 0, seed: int = 0) -> tuple[list, list]:
    """(requests for lm.eval.loglik.Scorer.score, the example index of each)."""
    out, owner = [], []
    for i, ex in enumerate(examples):
        context = fewshot_prefix(examples, i, shots, seed) + ex["context"]
        for choice in ex["choices"]:
            out.append(encode_pair(tokenizer, context, " " + choice))
            owner.append(i)
    return out, owner


def score_choices(scorer, examples: list[dict], shots: int = 0, seed: int = 0, progress=None) -> dict:
    """{'metrics': acc, acc_norm, ece; 'per_example': acc, acc_norm, p_answer; 'truncated'}."""
    reqs, owner = requests(examples, scorer.tokenizer, shots, seed)
    scores = scorer.score(reqs, progress)
    logps = [[] for _ in examples]
    for i, s in zip(owner, scores):
        logps[i].append(s.logp)
    acc, acc_norm, conf, p_answer = [], [], [], []
    for ex, lp in zip(examples, logps):
        chars = np.asarray([len(c) for c in ex["choices"]], np.float64)
        lp = np.asarray(lp, np.float64)
        probs = np.exp(lp - lp.max())
        probs /= probs.sum()
        acc.append(float(np.argmax(lp) == ex["answer"]))
        acc_norm.append(float(np.argmax(lp / chars) == ex["answer"]))
        conf.append(float(probs.max()))
        p_answer.append(float(probs[ex["answer"]]))
    per = {"acc": acc, "acc_norm": acc_norm, "p_answer": p_answer}
    metrics = {
        "acc": float(np.mean(acc)),
        "acc_norm": float(np.mean(acc_norm)),
        "ece": expected_calibration_error(conf, acc),
    }
    return {"metrics": metrics, "per_example": per, "n": len(examples), "truncated": sum(s.truncated for s in scores)}


def expected_calibration_error(confidence, correct, bins: int = ECE_BINS) -> float:
    """sum over equal-width confidence bins of (share of examples) * |accuracy - mean confidence|."""
    confidence, correct = np.asarray(confidence, np.float64), np.asarray(correct, np.float64)
    which = np.minimum((confidence * bins).astype(int), bins - 1)
    total = 0.0
    for b in range(bins):
        sel = which == b
        if sel.any():
            total += sel.mean() * abs(correct[sel].mean() - confidence[sel].mean())
    return float(total)
