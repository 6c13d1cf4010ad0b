"""The number a model's answer gives, for verifiable rewards (lm.train.verifiers).

`extract_number(text)` looks, in order, for:
  1. the last `\\boxed{...}` (braces nested): the number it holds (LaTeX `\\frac{a}{b}`,
     `a \\times 10^{b}`, `\\$`, `\\%`, `{,}` and spacing commands understood); a box without
     a number gives None, not a number from elsewhere: the answer was the box;
  2. the last `####` (GSM8K): the first number after it;
  3. else the last number of the text.
Numbers: signs (`-`, `+`, the Unicode minus), thousands commas (`1,234,567`: groups of three),
decimals (`.5`, `2.50`), scientific notation (`6.02e23`), fractions (`3/4`). Values are exact
Fractions (no float round-off on big integers or decimals); a huge exponent gives a float.
"""

from __future__ import annotations

import re
from fractions import Fraction

NUMBER = re.compile(
    r"(?P<sign>(?<![\w.])[-+])?"
    r"(?P<body>\d+/\d+(?![/\d])"  # a fraction
    r"|(?:\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+(?!\d))?)"
)
LATEX = (  # (pattern, replacement), applied in order to a box's content
    (re.compile(r"\\(?:text|mathrm|textbf|mathbf)\{([^{}]*)\}"), r"\1"),
    (re.compile(r"\\[dt]?frac\{\s*([^{}]*?)\s*\}\{\s*([^{}]*?)\s*\}"), r"\1/\2"),
    (re.compile(r"\\[dt]?frac(\d)(\d)"), r"\1/\2"),
    (re.compile(r"\s*(?:\\times|\\cdot|×)\s*10\s*\^\s*\{?\s*([-+]?\d+)\s*\}?"), r"e\1"),
    (re.compile(r"\{,\}"), ","),
    (re.compile(r"\\[!,;: ]|\\\$|\\%|\\left|\\right|[$%]"), ""),
)
MAX_EXPONENT = 300  # beyond: a float (inf or 0), not a Fraction with a thousand digits


def _clean(text: str) -> str:
    text = text.replace("\u2212", "-")  # the Unicode minus
    for pattern, replacement in LATEX:
        text = pattern.sub(replacement, text)
    return text


def _value(match: re.Match) -> Fraction | float | None:
    body = match.group("body").replace(",", "")
    sign = -1 if match.group("sign") == "-" else 1
    mantissa, _, exponent = body.lower().partition("e")
    if exponent and abs(int(exponent)) > MAX_EXPONENT:
        return sign * float(body)
    try:
        return sign * Fraction(body)
    except ZeroDivisionError:  # 3/0
        return None


def numbers_in(text: str) -> list[Fraction | float]:
    """Every number of the text, in order (LaTeX cleaned first)."""
    values = (_value(m) for m in NUMBER.finditer(_clean(text)))
    return [v for v in values if v is not None]


def boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (nested braces kept), None when there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None  # unclosed: no box


def extract_number(text: str) -> Fraction | float | None:
    """The answer's number (see the module doc), None when it gives none."""
    box = boxed(text)
    if box is not None:
        found = numbers_in(box)
        return found[-1] if found else None
    if "####" in text:
        found = numbers_in(text.rpartition("####")[2])
        return found[0] if found else None
    found = numbers_in(text)
    return found[-1] if found else None
