"""lm-evaluation-harness against an `lm` model: its model interface over the same scoring core
as `lm eval` (lm.eval.loglik, lm.eval.complete), so both give the same numbers.

    loglikelihood          (context, continuation) -> (summed log p, greedy?)   Scorer.score
    loglikelihood_rolling  (text,) -> log p of every token after end-of-text    Scorer.rolling
    generate_until         (context, {until, max_gen_toks, temperature}) -> text   completions

Importing this module registers the model as "lm" with the harness, so
`lm_eval.simple_evaluate(model="lm", model_args="workdir=RUN")` works too. Needs the `harness`
extra (pip install 'lm[harness]'); torch is not needed.
"""

from __future__ import annotations

from lm.errors import UserError

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError:  # pragma: no cover - the message is the point
    raise UserError("lm harness needs lm-evaluation-harness: pip install 'lm[harness]'") from None

DEFAULT_MAX_GEN = 256


@register_model("lm")
class HarnessModel(LM):
    """An `lm` run (workdir=) or export (params=) as a harness model; batch_size= rows per batch."""

    def __init__(self, workdir: str | None = None, params: str | None = None, tokenizer: str | None = None,
                 batch_size: int | str | None = None, scorer=None, **_ignored):
        super().__init__()
        if scorer is None:
            from lm.eval.loglik import Scorer
            from lm.infer.load import load_trained

            scorer = Scorer.from_loaded(load_trained(workdir, params, tokenizer), int(batch_size) if batch_size else None)
        self.scorer = scorer
        self.tok = scorer.tokenizer
        self.seen: list[tuple[str, tuple]] = []  # (request type, args), for inspection
        # Chat prompts the harness asked for, text -> ids: role tokens do not survive decode/encode,
        # so a context that is (or starts with) one is encoded from the template's own ids.
        self.rendered: dict[str, list[int]] = {}

    def _context_ids(self, text: str) -> list[int] | None:
        """The ids of a context that starts with a rendered chat prompt (None: no such prompt)."""
        if text in self.rendered:
            return list(self.rendered[text])
        for prompt, ids in self.rendered.items():
            if text.startswith(prompt):
                return list(ids) + [int(t) for t in self.tok.encode(text[len(prompt):])]
        return None

    def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        from lm.eval.loglik import encode_pair

        ids = self._context_ids(context) if self.rendered else None
        if ids is None:
            return encode_pair(self.tok, context, continuation)
        return ids, [int(t) for t in self.tok.encode(continuation)]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        args = [r.args for r in requests]
        self.seen += [("loglikelihood", a) for a in args]
        scores = self.scorer.score([self._pair(ctx, cont) for ctx, cont in args])
        return [(s.logp, s.greedy) for s in scores]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        texts = [r.args[0] for r in requests]
        self.seen += [("loglikelihood_rolling", (t,)) for t in texts]
        docs = [[int(i) for i in self.tok.encode(t)] for t in texts]
        return [s.logp for s in self.scorer.rolling(docs, prefix=int(self.tok.eos_id))]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from lm.eval.complete import completions

        out: list[str | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            self.seen.append(("generate_until", r.args))
            groups.setdefault(_settings(r.args[1]), []).append(i)
        s = self.scorer
        for (until, max_gen, temperature), idx in groups.items():
            prompts = [self._context_ids(requests[i].args[0]) or self.tok.encode(requests[i].args[0]) for i in idx]
            done = completions(s.model, s.params, self.tok, prompts, max_new_tokens=max_gen, stop=until,
                               mesh=s.mesh, rules=s.rules, batch_size=s.batch_size, temperature=temperature)
            for i, r in zip(idx, done):
                out[i] = r["text"]
        return out

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat template's text (lm.data.chat), ending with an open assistant turn; requests
        whose context is this text are scored from the template's ids."""
        from lm.data.chat import ChatTemplate

        template = ChatTemplate.for_tokenizer(self.tok)
        ids = template.prompt(chat_history) if add_generation_prompt else template.render(chat_history)[0]
        text = self.tok.decode(ids)
        self.rendered[text] = [int(t) for t in ids]
        return text

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tok, "name", "lm")


def _settings(gen_kwargs: dict) -> tuple:
    """(stop strings, max new tokens, temperature) of a request's generation arguments."""
    kw = dict(gen_kwargs or {})
    until = kw.get("until") or ()
    until = (until,) if isinstance(until, str) else tuple(until)
    temperature = float(kw.get("temperature", 0.0)) if kw.get("do_sample", False) else 0.0
    return until, int(kw.get("max_gen_toks", DEFAULT_MAX_GEN)), temperature


def run_harness(*, workdir: str | None = None, params: str | None = None, tasks: list[str],
                include_path: str | None = None, limit: int | None = None, batch_size: int | None = None,
                num_fewshot: int | None = None, tokenizer: str | None = None, model: HarnessModel | None = None,
                log_samples: bool = False) -> dict:
    """lm-evaluation-harness's results for `tasks` (names, found among its tasks and include_path);
    log_samples: with every request and response under 'samples'."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    model = model or HarnessModel(workdir, params, tokenizer, batch_size)
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        raise UserError(f"lm harness: unknown task(s) {', '.join(unknown)}; a local task is a YAML file in "
                        "--include-path (see lm-evaluation-harness's task guide)")
    return simple_evaluate(model=model, tasks=tasks, task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                           bootstrap_iters=0, log_samples=log_samples)


def harness_table(results: dict) -> str:
    from lm_eval.utils import make_table

    return make_table(results)
