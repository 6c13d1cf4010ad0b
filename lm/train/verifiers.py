"""Verifiable rewards for `rl.rewards`, with TRL's signature `fn(prompts, completions, **columns)`:

    lm.train.verifiers:exact_match              1 when the answer equals the `answer` column
    lm.train.verifiers:exact_match_ignore_case  the same, letter case aside
    lm.train.verifiers:numeric_match            1 when the answer's number equals the column's
    lm.train.verifiers:think_answer_format      1 for `<think>...</think><answer>...</answer>`

The answer of a completion is the text of its last `<answer>...</answer>` when it has one, else
the whole completion. Numbers are read from it (and from the column) by `extract_number`:
the last `\\boxed{...}`, else the number after the last `####` (GSM8K), else the last number.
Other columns, tolerances or patterns: build one with `make_exact_match`, `make_numeric_match`
or `make_regex_format` in a file of your own and name it (`my_rewards.py:strict`).

A missing column or a reference holding no number raises (the run stops naming the row): that
is the data's fault, not the completion's, and scoring it 0 would hide it.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Callable

from lm.train.answer_numbers import extract_number

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
THINK_ANSWER = re.compile(r"<think>((?:(?!</?think>).)*)</think>\s*<answer>((?:(?!</?answer>).)*)</answer>", re.S)


def answer_text(completion: str) -> str:
    """The text of the completion's last <answer>...</answer>, else the whole completion."""
    tags = ANSWER_TAG.findall(completion)
    return tags[-1] if tags else completion


def normalise(text: str, ignore_case: bool = False) -> str:
    """Whitespace runs as one space, ends stripped (and case folded when asked)."""
    text = " ".join(str(text).split())
    return text.casefold() if ignore_case else text


def _references(name: str, column: str, values, n: int) -> list:
    if values is None:
        raise ValueError(f"{name} needs the column '{column}' in the prompt lines")
    if len(values) != n:
        raise ValueError(f"{name}: {len(values)} values of column '{column}' for {n} completions")
    for v in values:
        if v is None:
            raise ValueError(f"{name}: a prompt line has no '{column}'")
    return list(values)


def make_exact_match(column: str = "answer", ignore_case: bool = False, spaces: bool = True) -> Callable:
    """A reward: 1.0 when the completion's answer equals the row's `column`, else 0.0.
    spaces=True: whitespace normalised on both sides; ignore_case: letter case aside."""
    name = "exact_match" + ("_ignore_case" if ignore_case else "")

    def same(a, b) -> bool:
        if spaces:
            return normalise(a, ignore_case) == normalise(b, ignore_case)
        return (a.casefold() == b.casefold()) if ignore_case else a == b

    def exact_match(prompts, completions, **columns) -> list[float]:
        refs = _references(name, column, columns.get(column), len(completions))
        return [float(same(answer_text(c), str(r))) for c, r in zip(completions, refs)]

    exact_match.__name__ = name
    return exact_match


def numbers_equal(a: Fraction | float, b: Fraction | float, rel_tol: float, abs_tol: float) -> bool:
    """Within the tolerance, as math.isclose; in exact arithmetic when both are fractions (no float
    round-off on big integers)."""
    if a == b:
        return True
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return abs(a - b) <= max(Fraction(rel_tol) * max(abs(a), abs(b)), Fraction(abs_tol))
    try:
        return math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=abs_tol)
    except OverflowError:  # a Fraction beyond float's range, unequal to the other
        return False


def reference_number(value, name: str, column: str) -> Fraction | float:
    """A column's value as a number: a JSON number, or text read by `extract_number`."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return Fraction(value) if math.isfinite(value) else float(value)
    number = extract_number(str(value))
    if number is None:
        raise ValueError(f"{name}: the '{column}' value {str(value)[:80]!r} holds no number")
    return number


def make_numeric_match(column: str = "answer", rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> Callable:
    """A reward: 1.0 when the number of the completion's answer equals the row's `column` within
    rel_tol/abs_tol (math.isclose), else 0.0 (no number: 0.0)."""

    def numeric_match(prompts, completions, **columns) -> list[float]:
        refs = _references("numeric_match", column, columns.get(column), len(completions))
        out = []
        for c, r in zip(completions, refs):
            want, got = reference_number(r, "numeric_match", column), extract_number(answer_text(c))
            out.append(float(got is not None and numbers_equal(got, want, rel_tol, abs_tol)))
        return out

    return numeric_match


def make_regex_format(pattern: str, flags: int = re.S) -> Callable:
    """A reward: 1.0 when the whole completion (outer whitespace stripped) matches `pattern`."""
    compiled = re.compile(pattern, flags)

    def regex_format(prompts, completions, **columns) -> list[float]:
        return [float(compiled.fullmatch(c.strip()) is not None) for c in completions]

    return regex_format


exact_match = make_exact_match()
exact_match_ignore_case = make_exact_match(ignore_case=True)
numeric_match = make_numeric_match()


def think_answer_format(prompts, completions, **columns) -> list[float]:
    """1.0 for exactly `<think>...</think>` then `<answer>...</answer>` (whitespace around and
    between them allowed, no nested or repeated tags), else 0.0."""
    return [float(THINK_ANSWER.fullmatch(c.strip()) is not None) for c in completions]
