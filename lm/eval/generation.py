"""Generation tasks: a prompt, an answer from the KV-cache sampler (greedy), a score.

An example is {"prompt", "answer"} (a string, or a list of accepted strings) or a chat
{"messages": [..., assistant turn]} whose last turn is the reference. With the chat template
(default for chat lines) the prompt is rendered as a user turn and the answer ends at the
end-of-turn marker; raw prompts are continued as text until a stop string (default a newline).

Scorers: exact (after trimming whitespace), normalized (lower case, no punctuation, no articles,
single spaces: the SQuAD normalisation), a Python checker `module:function` or
`file.py:function` called as fn(prediction, example) -> bool or float, rouge_l (F-measure, the
rouge-score package) and bleu (sacrebleu: sentence BLEU per example, corpus BLEU for the task).
"""

from __future__ import annotations

import re
import string

from lm.config.userfn import load_function
from lm.data.chat import ChatTemplate, chat_prompts
from lm.errors import UserError
from lm.eval.complete import completions

SCORERS = ("exact", "normalized", "checker", "rouge_l", "bleu")


def parse_generation(obj: dict, where: str) -> dict:
    """A checked example: {'messages' (the prompt turns) or 'prompt', 'answers': [str], 'record'}."""
    if isinstance(obj.get("messages"), list):
        msgs = obj["messages"]
        if (
            len(msgs) < 2
            or not isinstance(msgs[-1], dict)
            or msgs[-1].get("role") != "assistant"
            or not isinstance(msgs[-1].get("content"), str)
        ):
            raise UserError(
                f"{where}: a chat example needs a prompt turn and must end with an assistant turn "
                "(the reference answer)"
            )
        return {"messages": msgs[:-1], "answers": [msgs[-1]["content"]], "record": obj}
    prompt, answer = obj.get("prompt"), obj.get("answer")
    answers = [answer] if isinstance(answer, str) else answer
    if (
        not isinstance(prompt, str)
        or not prompt
        or not isinstance(answers, list)
        or not answers
        or not all(isinstance(a, str) for a in answers)
    ):
        raise UserError(
            f'{where}: expected {{"prompt": str, "answer": str or [str]}} or '
            '{"messages": [..., {"role": "assistant", ...}]}'
        )
    return {"prompt": prompt, "answers": answers, "record": obj}


def normalize(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def make_scorer(name: str, checker: str = ""):
    """prediction, example -> float in [0, 1]."""
    if name == "exact":
        return lambda pred, ex: float(any(pred.strip() == a.strip() for a in ex["answers"]))
    if name == "normalized":
        return lambda pred, ex: float(any(normalize(pred) == normalize(a) for a in ex["answers"]))
    if name == "checker":
        if not checker:
            raise UserError("scorer=checker needs checker=module:function (fn(prediction, example) -> bool/float)")
        fn = load_function(checker, "eval checker")
        return lambda pred, ex: float(fn(pred, ex["record"]))
    if name == "rouge_l":
        rouge = _import("rouge_score.rouge_scorer", "rouge-score").RougeScorer(["rougeL"], use_stemmer=False)
        return lambda pred, ex: max(rouge.score(a, pred)["rougeL"].fmeasure for a in ex["answers"])
    if name == "bleu":
        bleu = _import("sacrebleu", "sacrebleu")
        return lambda pred, ex: bleu.sentence_bleu(pred, ex["answers"]).score / 100.0
    raise UserError(f"scorer '{name}'; expected one of {', '.join(SCORERS)}")


def _import(module: str, package: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"this scorer needs the '{package}' package: pip install 'lm[eval]'") from None


def prompt_ids(examples: list[dict], tokenizer, chat: bool) -> list:
    if not chat:
        if any("prompt" not in ex for ex in examples):
            raise UserError('chat=false needs {"prompt"} examples; chat lines go through the chat template')
        return [tokenizer.encode(ex["prompt"]) for ex in examples]
    return chat_prompts(tokenizer, [ex.get("messages") or ex["prompt"] for ex in examples])[0]


def score_generation(
    scorer_model,
    examples: list[dict],
    *,
    scorer: str = "exact",
    checker: str = "",
    chat: bool = True,
    max_new_tokens: int = 64,
    stop: tuple[str, ...] = ("\n",),
    keep: int = 5,
) -> dict:
    """{'metrics': {scorer: mean}, 'per_example': {scorer: [...]}, 'samples': first `keep`}.
    scorer_model: a lm.eval.loglik.Scorer (its model, params, mesh and batch size)."""
    m, tok = scorer_model, scorer_model.tokenizer
    score = make_scorer(scorer, checker)
    stop_strings, eos = stop, None
    if chat:
        template = ChatTemplate.for_tokenizer(tok)
        stop_strings, eos = template.stop_strings, template.stop_ids
    done = completions(
        m.model,
        m.params,
        tok,
        prompt_ids(examples, tok, chat),
        max_new_tokens=max_new_tokens,
        stop=stop_strings,
        eos_ids=eos,
        mesh=m.mesh,
        rules=m.rules,
        batch_size=m.batch_size,
    )
    preds = [r["text"] for r in done]
    values = [score(p, ex) for p, ex in zip(preds, examples)]
    metrics = {scorer: sum(values) / len(values)}
    if scorer == "bleu":
        bleu = _import("sacrebleu", "sacrebleu")
        refs = [[ex["answers"][0] for ex in examples]]
        metrics["corpus_bleu"] = bleu.corpus_bleu(preds, refs).score / 100.0
    samples = [
        {
            "prompt": ex.get("prompt") or ex["messages"][-1].get("content"),
            "reference": ex["answers"][0],
            "prediction": p,
        }
        for ex, p in zip(examples[:keep], preds)
    ]
    return {
        "metrics": metrics,
        "per_example": {scorer: values},
        "n": len(values),
        "samples": samples,
        "prompt_cut": sum(1 for r in done if r["prompt_cut"]),
    }
