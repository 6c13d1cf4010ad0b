"""lm-evaluation-harness against an `lm` model: its model interface over the same scoring core
as `lm eval` (lm.eval.loglik, lm.eval.complete), so both give the same numbers.

    loglikelihood          (context, continuation) -> (summed log p, greedy?)   Scorer.score
    loglikelihood_rolling  (text,) -> log p of every token after end-of-text    Scorer.score, the harness's windows
    generate_until         (context, {until, max_gen_toks, do_sample, temperature}) -> text    completions

Importing this module registers the model as "lm" with the harness, so
`lm_eval.simple_evaluate(model="lm", model_args="workdir=RUN,batch_size=16")` works too. Needs the
`harness` extra (pip install 'lm[harness]'); torch is not needed.
"""

from __future__ import annotations

import contextlib
import logging
import sys

import numpy as np

from lm.errors import UserError

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from tqdm import tqdm
except ImportError:  # pragma: no cover - the message is the point
    raise UserError("lm harness needs lm-evaluation-harness: pip install 'lm[harness]'") from None

DEFAULT_MAX_GEN = 256  # the harness's own default for max_gen_toks
USED_GEN_KWARGS = {"until", "max_gen_toks", "do_sample", "temperature"}
_warned: set[str] = set()


@register_model("lm")
class HarnessModel(LM):
    """An `lm` run (workdir=, step=) or export (params=) as a harness model; batch_size= rows per
    batch (default: the run's eval.batch_size). scorer=: an lm.eval.loglik.Scorer already built."""

    def __init__(
        self,
        workdir: str | None = None,
        params: str | None = None,
        tokenizer: str | None = None,
        step: int | None = None,
        batch_size: int | str | None = None,
        scorer=None,
        max_batch_size=None,
        device=None,
        **unknown,
    ):
        super().__init__()  # max_batch_size, device: the harness passes them; the mesh decides placement
        if unknown:
            raise UserError(
                f"lm harness: unknown model argument(s) {', '.join(sorted(unknown))}; "
                "expected workdir, params, tokenizer, step, batch_size"
            )
        self.source = "a given Scorer"
        if scorer is None:
            from lm.eval.loglik import Scorer
            from lm.store.load import load_trained

            loaded = load_trained(workdir, params, tokenizer, step=None if step is None else int(step))
            auto = batch_size is None or str(batch_size).startswith("auto")  # the harness's "auto": ours
            scorer, self.source = Scorer.from_loaded(loaded, None if auto else int(batch_size)), loaded.source
        self.scorer, self.tok = scorer, scorer.tokenizer
        # Chat prompts rendered for the harness, text -> ids: role tokens do not survive decode and
        # encode, so a context the harness got from apply_chat_template is scored from these ids.
        self.rendered: dict[str, list[int]] = {}

    # ---- requests ----------------------------------------------------------------------------

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self._pair(*r.args[:2]) for r in requests]
        todo = [i for i, (_, cont) in enumerate(pairs) if cont]  # an empty continuation: log 1, greedy
        out = [(0.0, True)] * len(pairs)
        with tqdm(total=len(todo), desc="loglikelihood", disable=disable_tqdm) as bar:
            for i, s in zip(todo, self.scorer.score([pairs[i] for i in todo], progress=bar.update)):
                out[i] = (s.logp, s.greedy)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Every token after end-of-text, in the harness's windows: max_len predictions each, the
        last window given as much of the preceding text as fits (its `get_rolling_token_windows`)."""
        pairs, owner = [], []
        for d, r in enumerate(requests):
            ids = [int(self.tok.eos_id)] + _ints(self.tok.encode(r.args[0]))
            pairs += _windows(ids, self.scorer.max_len)
            owner += [d] * (len(pairs) - len(owner))
        out = [0.0] * len(requests)
        with tqdm(total=len(pairs), desc="loglikelihood_rolling", disable=disable_tqdm) as bar:
            for d, s in zip(owner, self.scorer.score(pairs, progress=bar.update)):
                out[d] += s.logp
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from lm.eval.complete import completions

        groups: dict[tuple, list[int]] = {}  # requests of one generation setting and prompt kind
        for i, r in enumerate(requests):
            groups.setdefault(_settings(r.args[1]) + (r.args[0] in self.rendered,), []).append(i)
        s, out = self.scorer, [""] * len(requests)
        with tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm) as bar:
            for (until, max_gen, temperature, chat), idx in groups.items():
                stop, eos = until, (int(self.tok.eos_id),)
                if chat:  # an answer in the chat template also ends at its end marker
                    stop, eos = until + self._template().stop_strings, self._template().stop_ids
                for start in range(0, len(idx), s.batch_size):
                    part = idx[start : start + s.batch_size]
                    prompts = [self._context(requests[i].args[0]) for i in part]
                    done = completions(
                        s.model,
                        s.params,
                        self.tok,
                        prompts,
                        max_new_tokens=max_gen,
                        stop=stop,
                        eos_ids=eos,
                        mesh=s.mesh,
                        rules=s.rules,
                        batch_size=s.batch_size,
                        temperature=temperature,
                    )
                    for i, d in zip(part, done):
                        out[i] = d["text"]
                    bar.update(len(part))
        return out

    # ---- chat ----------------------------------------------------------------------------------

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt in lm.data.chat's template, as text; its ids are kept for scoring. Without
        add_generation_prompt the last turn is the assistant's opening (a task's gen_prefix), left
        open. Empty turns (a task without a prompt, e.g. perplexity) are left out; none left: ''."""
        history = [m for m in chat_history if m.get("content")]
        opening = [] if add_generation_prompt or not history else [history.pop()]
        if not history:
            return ""
        try:
            if opening and opening[0].get("role") != "assistant":
                raise ValueError(f"the last message has role '{opening[0].get('role')}'; expected an assistant opening")
            from lm.data.chat import prompt_ids

            ids = prompt_ids(self._template(), history)
            ids += [t for m in opening for t in _ints(self.tok.encode(m["content"]))]
        except ValueError as e:
            raise UserError(f"lm harness: chat template: {e}") from None
        text = self.tok.decode(ids)
        self.rendered[text] = ids
        return text

    @property
    def tokenizer_name(self) -> str:
        """Names the tokenizer and template version in the harness's request-cache keys."""
        return f"lm-{self.tok.fingerprint()}-chat-v{self._template().key}"

    def get_model_info(self) -> dict:
        return {"lm_source": self.source}

    def _template(self):
        from lm.data.chat import ChatTemplate

        return ChatTemplate.for_tokenizer(self.tok)

    def _context(self, text: str) -> list[int]:
        """A prompt's ids: the template's own for a chat prompt rendered here, else its encoding
        (end-of-text for an empty one)."""
        ids = self.rendered.get(text)
        return list(ids) if ids is not None else _ints(self.tok.encode(text)) or [int(self.tok.eos_id)]

    def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        if context in self.rendered:
            return self._context(context), _ints(self.tok.encode(continuation))
        from lm.eval.loglik import encode_pair

        return encode_pair(self.tok, context, continuation)


def _ints(ids) -> list[int]:
    return [int(t) for t in np.asarray(ids).reshape(-1)]


def _windows(ids: list[int], max_len: int) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) per window of max_len predictions over ids[1:]; the context is
    whatever precedes the window, up to max_len + 1 tokens per row in all."""
    out = []
    for start in range(1, len(ids), max_len):
        end = min(start + max_len, len(ids))
        out.append((ids[max(0, end - max_len - 1) : start], ids[start:end]))
    return out


def _settings(gen_kwargs: dict) -> tuple:
    """(stop strings, max new tokens, temperature) of a request's generation arguments; greedy
    unless do_sample (then temperature 1 unless given)."""
    kw = dict(gen_kwargs or {})
    ignored = sorted(set(kw) - USED_GEN_KWARGS - _warned)
    if ignored:
        _warned.update(ignored)
        print(f"lm harness: ignoring generation setting(s) {', '.join(ignored)}", file=sys.stderr, flush=True)
    until = kw.get("until") or ()
    until = (until,) if isinstance(until, str) else tuple(until)
    temperature = float(kw.get("temperature", 1.0)) if kw.get("do_sample", False) else 0.0
    return until, int(kw.get("max_gen_toks", DEFAULT_MAX_GEN)), temperature


@contextlib.contextmanager
def _quiet(verbose: bool):
    """The harness's info logs and the datasets library's progress bars off (restored after)."""
    import datasets

    logger = logging.getLogger("lm_eval")
    level, bars = logger.level, datasets.is_progress_bar_enabled()
    if not verbose:
        logger.setLevel(logging.WARNING)
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        logger.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


def _task_manager(tasks: list[str], include_path: str | None):
    """The local tasks alone when every name is one of them (indexing the harness's thousands of
    task files takes seconds), else all tasks; unknown names are an error."""
    from lm_eval.tasks import TaskManager

    if include_path:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if set(tasks) <= set(local.all_subtasks):
            return local
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        raise UserError(
            f"lm harness: unknown task(s) {', '.join(unknown)}; a local task is a YAML file in "
            "--include-path (see lm-evaluation-harness's task guide)"
        )
    return manager


def run_harness(
    *,
    workdir: str | None = None,
    params: str | None = None,
    tasks: list[str],
    include_path: str | None = None,
    limit: int | None = None,
    batch_size: int | None = None,
    num_fewshot: int | None = None,
    tokenizer: str | None = None,
    apply_chat_template: bool = False,
    bootstrap_iters: int = 1000,
    log_samples: bool = False,
    verbose: bool = False,
    model: HarnessModel | None = None,
) -> dict:
    """lm-evaluation-harness's results dict for `tasks` (its own, or YAML files in include_path)
    on a run (workdir) or an export (params), or on `model`. log_samples: every request and
    response under 'samples'. bootstrap_iters: for standard errors (0: none; the harness bootstraps
    metrics such as f1 in forked workers unless DISABLE_MULTIPROC=1, which `lm harness` sets)."""
    from lm_eval import simple_evaluate

    if not tasks:
        raise UserError("lm harness: no tasks given (--tasks T1,T2)")
    with _quiet(verbose):
        manager = _task_manager(tasks, include_path)
        model = model or HarnessModel(workdir, params, tokenizer, batch_size=batch_size)
        try:
            return simple_evaluate(
                model=model,
                tasks=tasks,
                task_manager=manager,
                limit=limit,
                num_fewshot=num_fewshot,
                apply_chat_template=apply_chat_template,
                bootstrap_iters=bootstrap_iters,
                log_samples=log_samples,
            )
        except Exception as e:
            task = _downloading_task(e)
            if task is None:
                raise
            raise UserError(_dataset_error(task, e)) from None


def _downloading_task(error: BaseException):
    """The harness task whose dataset download raised `error`, or None when it came from elsewhere."""
    import traceback

    from lm_eval.api.task import Task

    for frame, _ in traceback.walk_tb(error.__traceback__):
        task = frame.f_locals.get("self")
        if frame.f_code.co_name == "download" and isinstance(task, Task):
            return task
    return None


def _dataset_error(task, error: BaseException) -> str:
    name = getattr(getattr(task, "config", None), "task", None) or type(task).__name__
    path, subset = getattr(task, "DATASET_PATH", None), getattr(task, "DATASET_NAME", None)
    dataset = f"'{path}'" + (f" (subset '{subset}')" if subset else "")
    reason = " ".join(str(error).split()) or type(error).__name__
    return (
        f"lm harness: task '{name}': its dataset {dataset} could not be loaded ({reason}); download it once "
        "with network access (the datasets library caches it under HF_DATASETS_CACHE, and --offline or "
        "HF_DATASETS_OFFLINE=1 then reads that cache), or give a local task in --include-path whose YAML reads "
        "local files (dataset_path: json, dataset_kwargs: {data_files: FILE})"
    )


def harness_table(results: dict) -> str:
    """The harness's own table of results (and of groups, when tasks form one)."""
    from lm_eval.utils import make_table

    table = make_table(results)
    return table + ("\n" + make_table(results, "groups") if results.get("groups") else "")
