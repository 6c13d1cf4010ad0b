"""Evaluation tasks named on the command line, and running them against one model.

A task spec is `[NAME=]PATH[?key=value&...]`. The kind follows from the data: a token shard
set, a corpus directory or glob, a text file or JSONL of {"text"} lines is a language-modelling
set; JSONL of {"context", "choices", "answer"} is multiple choice; JSONL of {"prompt",
"answer"} or chat {"messages"} is a generation task. Options (all optional):
  limit=N         the first N examples (language modelling: at most N tokens)
  shots=K, seed=S multiple choice: K solved examples before each (drawn with seed S)
  scorer=...      generation: exact | normalized | checker | rouge_l | bleu; checker=module:fn
  chat=true|false generation: through the chat template (default: for chat lines)
  max_new_tokens=N, stop=TEXT   generation limits (stop: raw prompts, default a newline)
"""

from __future__ import annotations

import dataclasses
import pathlib
import urllib.parse

from lm.errors import UserError
from lm.eval import choice, generation, sets
from lm.eval.taskfile import read_task_file

OPTIONS = {
    "limit": int,
    "shots": int,
    "seed": int,
    "scorer": str,
    "checker": str,
    "chat": str,
    "max_new_tokens": int,
    "stop": str,
    "kind": str,
}
KINDS = ("lm", "choice", "generation")
DEFAULT_LM_TOKENS = 1 << 20  # a language-modelling set is cut to this many tokens unless limit= says otherwise


@dataclasses.dataclass
class Task:
    name: str
    path: str
    kind: str
    options: dict


def parse_task(spec: str) -> Task:
    head, _, query = spec.partition("?")
    name, eq, path = head.partition("=")
    if not eq:
        name, path = pathlib.Path(head.rstrip("/")).stem or head, head
    options = {}
    for key, value in urllib.parse.parse_qsl(query, keep_blank_values=True):
        if key not in OPTIONS:
            raise UserError(f"task '{spec}': unknown option '{key}'; known: {', '.join(OPTIONS)}")
        try:
            options[key] = OPTIONS[key](value)
        except ValueError:
            raise UserError(f"task '{spec}': option {key}={value!r} is not an {OPTIONS[key].__name__}") from None
    kind = options.pop("kind", None) or _kind_of(path)
    if kind not in KINDS:
        raise UserError(f"task '{spec}': kind '{kind}'; expected one of {', '.join(KINDS)}")
    return Task(name, path, kind, options)


def _kind_of(path: str) -> str:
    p = pathlib.Path(path)
    if not (p.is_file() and p.suffix == ".jsonl"):
        return "lm"  # a text file, a corpus or a shard set
    first = read_task_file(p, limit=1)[0][1]
    if "choices" in first:
        return "choice"
    if "text" in first and "prompt" not in first and "messages" not in first:
        return "lm"
    return "generation"


def run_task(task: Task, scorer, progress=None) -> dict:
    """One task's report entry: kind, path, n, metrics, per_example, example_ids (+ samples, counts)."""
    o = task.options
    head = {"kind": task.kind, "path": task.path, "options": o}
    if task.kind == "lm":
        docs = sets.read_set(task.path, scorer.tokenizer, o.get("limit", DEFAULT_LM_TOKENS))
        return head | sets.score_set(scorer, docs, progress)
    lines = read_task_file(task.path, o.get("limit", 0))
    ids = [n for n, _ in lines]
    if task.kind == "choice":
        examples = [choice.parse_choice(obj, f"{task.path}:{n}") for n, obj in lines]
        out = choice.score_choices(scorer, examples, o.get("shots", 0), o.get("seed", 0), progress)
    else:
        examples = [generation.parse_generation(obj, f"{task.path}:{n}") for n, obj in lines]
        chat = o.get("chat", "auto")
        use_chat = ("messages" in examples[0]) if chat == "auto" else chat.lower() in ("1", "true", "yes")
        out = generation.score_generation(
            scorer,
            examples,
            scorer=o.get("scorer", "exact"),
            checker=o.get("checker", ""),
            chat=use_chat,
            max_new_tokens=o.get("max_new_tokens", 64),
            stop=(o["stop"],) if "stop" in o else ("\n",),
        )
    return head | out | {"example_ids": ids}
