"""Verifiable rewards on hand-picked completions, tricky ones included: exact match (whitespace,
case, the <answer> tag), numbers (boxed LaTeX, GSM8K's ####, the last number; fractions, commas,
signs, scientific notation) compared exactly or within a tolerance, and format checks; they
load as `rl.rewards` entries, and bad references raise naming the column."""

from fractions import Fraction

import pytest

from lm.train import verifiers
from lm.train.answer_numbers import extract_number
from lm.train.rewards import call_reward, parse_rewards

F = Fraction


@pytest.mark.parametrize(
    "text, number",
    [
        ("The answer is 42.", 42),  # a sentence's full stop is not a decimal point
        ("so x = -3", -3),
        ("\u22127 degrees", -7),  # the Unicode minus
        ("+5", 5),
        ("2024-01-05", 5),  # a hyphen between digits is no sign
        ("x-5", 5),
        ("costs $1,000,000.", 1_000_000),
        ("1,2,3", 3),  # not a thousands group: three numbers
        ("1,0000", 0),  # a group of four digits is no thousands group
        (".5 of it", F(1, 2)),
        ("2.50", F(5, 2)),
        ("6.02e23 atoms", F(602) * 10**21),
        ("1.5E-3", F(3, 2000)),
        ("3/4 of 8 is 6", 6),  # the last number
        ("it is 3/4", F(3, 4)),
        ("-3/4", F(-3, 4)),
        ("3/0 and 2", 2),  # no value for 3/0
        ("90071992547409931", 90071992547409931),  # beyond float's exact integers
        ("first 12 then #### 1,234 and 7", 1234),  # the first number after the last ####
        ("#### no number", None),
        (r"so \boxed{\frac{3}{4}} and 9", F(3, 4)),  # a box wins over later numbers
        (r"\boxed{\dfrac12}", F(1, 2)),
        (r"\boxed{-\frac{1}{3}}", F(-1, 3)),
        (r"\boxed{1.5 \times 10^{3}}", 1500),
        (r"\boxed{1{,}000}", 1000),
        (r"\boxed{\$5}", 5),
        (r"\boxed{50\%}", 50),
        (r"\boxed{x = \text{12}}", 12),
        (r"\boxed{{2}}", 2),  # nested braces
        (r"7 then \boxed{\text{no}}", None),  # a box without a number: none, not the 7
        (r"\boxed{3} then \boxed{4}", 4),  # the last box
        (r"\boxed{5", 5),  # unclosed: no box, the last number
        ("no digits here", None),
        ("1e999", float("inf")),  # a huge exponent: a float, not a thousand-digit fraction
    ],
)
def test_extract_number(text, number):
    got = extract_number(text)
    assert got == number and (number is None or isinstance(got, (Fraction, float)))


def score(fn, completions, answers):
    return fn(["q"] * len(completions), completions, answer=answers)


def test_exact_match_normalises_whitespace_and_reads_the_answer_tag():
    completions = [
        "  Paris ",
        "Paris\n",
        "paris",
        "New  York",
        "<think>Lyon?</think><answer> Paris </answer>",
        "Parisx",
    ]
    answers = ["Paris", "Paris", "Paris", "New York", "Paris", "Paris"]
    assert score(verifiers.exact_match, completions, answers) == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert score(verifiers.exact_match_ignore_case, completions, answers) == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    # the last <answer> counts
    assert score(verifiers.exact_match, ["<answer>a</answer> <answer>b</answer>"], ["b"]) == [1.0]
    strict = verifiers.make_exact_match(column="label", spaces=False)
    assert strict(["q", "q"], ["a b", "a  b"], label=["a b", "a b"]) == [1.0, 0.0]


def test_numeric_match_by_value_and_tolerance():
    completions = [
        r"so \boxed{\frac{1}{2}}",
        "I get 0.5000",
        "the total is $1,234.",
        "-0.0",
        "It is 0.333",
        "no idea",
        "<answer>72</answer> (checked with 71)",
        "6.02e23",
    ]
    answers = ["0.5", "1/2", "Adding up... #### 1234", "0", "1/3", "4", 72, "602000000000000000000000"]
    assert score(verifiers.numeric_match, completions, answers) == [1, 1, 1, 1, 0, 0, 1, 1]
    loose = verifiers.make_numeric_match(rel_tol=1e-2)
    assert score(loose, ["It is 0.333", "3.2"], ["1/3", "3"]) == [1.0, 0.0]
    # fractions compare in exact arithmetic: as floats these two big integers are equal
    exact = verifiers.make_numeric_match(rel_tol=0.0, abs_tol=0.0)
    assert score(exact, ["90071992547409931", "0.1"], ["90071992547409930", "1/10"]) == [0.0, 1.0]


def test_format_checks():
    fmt = verifiers.think_answer_format
    completions = [
        "<think>add them</think><answer>5</answer>",
        "\n<think>\nmulti\nline\n</think>\n\n<answer>5</answer>\n",
        "<answer>5</answer>",
        "<think>a</think><answer>5</answer> trailing",
        "<think>a</think><think>b</think><answer>5</answer>",
        "<think>a <think> b</think><answer>5</answer>",
        "<answer>5</answer><think>a</think>",
        "<think>a</think><answer>5</answer><answer>6</answer>",
    ]
    assert fmt(["q"] * len(completions), completions) == [1, 1, 0, 0, 0, 0, 0, 0]
    boxed = verifiers.make_regex_format(r".*\\boxed\{[^{}]+\}")
    assert boxed(["q"] * 3, ["so \\boxed{4}", "so \\boxed{4} ok", "4"]) == [1.0, 0.0, 0.0]


def test_verifiers_load_as_rl_rewards_and_bad_references_name_the_column():
    fns = parse_rewards("lm.train.verifiers:numeric_match, lm.train.verifiers:think_answer_format=0.2")
    assert [(f.name, f.weight) for f in fns] == [("numeric_match", 1.0), ("think_answer_format", 0.2)]
    assert call_reward(fns[0], ["q"], ["#### 4"], {"answer": ["4"]}).tolist() == [1.0]
    with pytest.raises(Exception, match="numeric_match needs the column 'answer'"):
        call_reward(fns[0], ["q"], ["4"], {})
    with pytest.raises(Exception, match=r"on completion 1 of 2 .*'answer' value 'n/a' holds no number"):
        call_reward(fns[0], ["q", "r"], ["4", "5"], {"answer": ["4", "n/a"]})
    with pytest.raises(Exception, match="a prompt line has no 'answer'"):
        call_reward(parse_rewards("lm.train.verifiers:exact_match")[0], ["q"], ["4"], {"answer": [None]})
