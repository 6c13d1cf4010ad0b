"""Tasks the project generates and can check exactly: the data of the post-training demo.

`sort`: "sort 70931" -> "01379". Each digit is one token of a digit-splitting BPE (ours), the
answer is unique, and a 4-layer model learns it in a few hundred steps, so supervised
fine-tuning, preference training and RL can each show a measured gain on held-out prompts.
Held-out prompts never appear in the training split (the split is by a hash of the digits).
"""

from __future__ import annotations

import hashlib
import json
import pathlib

import numpy as np

from lm.errors import UserError

MIN_DIGITS, MAX_DIGITS = 3, 8
HELDOUT_BUCKET = 10  # one prompt in ten (by hash) may only be held out


def _heldout(digits: str) -> bool:
    return int(hashlib.sha256(digits.encode()).hexdigest()[:8], 16) % HELDOUT_BUCKET == 0


def sort_prompt(digits: str) -> str:
    return f"sort {digits}"


def sort_answer(prompt: str) -> str | None:
    """The correct answer to a prompt of the task, or None if it is not one."""
    head, _, digits = prompt.strip().partition(" ")
    if head != "sort" or not digits.isdigit():
        return None
    return "".join(sorted(digits))


def is_correct(prompt: str, response: str) -> bool:
    """Exact match after trimming surrounding whitespace."""
    answer = sort_answer(prompt)
    return answer is not None and response.strip() == answer


def _prompt_text(prompt) -> str:
    """A prompt as given in a prompt file (a string or chat messages) -> its last user turn's text."""
    if isinstance(prompt, list):
        users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        return users[-1] if users else ""
    return str(prompt)


def sort_reward(prompts: list, completions: list[str], **columns) -> list[float]:
    """An RL reward function (lm.train.rewards): 1 for the exact answer to each prompt, else 0."""
    return [float(is_correct(_prompt_text(p), c)) for p, c in zip(prompts, completions)]


def wrong_answer(prompt: str, rng: np.random.Generator) -> str:
    """A plausible wrong answer: the sorted digits with one neighbouring pair swapped, or a digit
    dropped or repeated (for preference pairs)."""
    answer = list(sort_answer(prompt))
    kind = rng.integers(3)
    pairs = [i for i in range(len(answer) - 1) if answer[i] != answer[i + 1]]
    if kind == 0 and pairs:
        i = pairs[rng.integers(len(pairs))]
        answer[i], answer[i + 1] = answer[i + 1], answer[i]
    elif kind == 1:
        del answer[rng.integers(len(answer))]
    else:
        i = rng.integers(len(answer))
        answer.insert(i, answer[i])
    return "".join(answer)


def sort_examples(n: int, heldout: bool, seed: int) -> list[dict]:
    """n distinct chat examples {"messages": [user, assistant]} of one split."""
    rng = np.random.default_rng(seed)
    seen, out = set(), []
    while len(out) < n:
        digits = "".join(map(str, rng.integers(0, 10, rng.integers(MIN_DIGITS, MAX_DIGITS + 1))))
        if digits in seen or _heldout(digits) != heldout:
            continue
        seen.add(digits)
        prompt = sort_prompt(digits)
        out.append(
            {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": sort_answer(prompt)}]}
        )
    return out


def write_sort_task(out_dir, n_train: int = 20000, n_heldout: int = 256, seed: int = 0) -> dict:
    """Writes OUT/train.jsonl and OUT/heldout.jsonl; returns their paths."""
    if n_train < 1 or n_heldout < 1:
        raise UserError(f"sort task: n_train ({n_train}) and n_heldout ({n_heldout}) must be >= 1")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, n, held in (("train", n_train, False), ("heldout", n_heldout, True)):
        paths[split] = out / f"{split}.jsonl"
        rows = sort_examples(n, held, seed + int(held))
        paths[split].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def sort_pairs(n: int, heldout: bool, seed: int) -> list[dict]:
    """n preference pairs {"prompt", "chosen": the answer, "rejected": a plausible wrong one} of
    one split (the prompts of `sort_examples` with the same arguments)."""
    rng = np.random.default_rng(seed + 7919)
    out = []
    for example in sort_examples(n, heldout, seed):
        prompt = example["messages"][0]["content"]
        out.append({"prompt": prompt, "chosen": sort_answer(prompt), "rejected": wrong_answer(prompt, rng)})
    return out


def write_sort_pairs(out_dir, n_train: int = 4000, n_heldout: int = 256, seed: int = 0) -> dict:
    """Writes OUT/pairs_train.jsonl and OUT/pairs_heldout.jsonl (held-out prompts are those of
    `write_sort_task`'s held-out split with the same seed); returns their paths."""
    if n_train < 1 or n_heldout < 1:
        raise UserError(f"sort pairs: n_train ({n_train}) and n_heldout ({n_heldout}) must be >= 1")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, n, held in (("train", n_train, False), ("heldout", n_heldout, True)):
        paths[split] = out / f"pairs_{split}.jsonl"
        rows = sort_pairs(n, held, seed + int(held))
        paths[split].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths
