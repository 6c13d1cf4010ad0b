"""`lm sft`: supervised fine-tuning of a trained model on conversations, fully or with LoRA.

The run starts from the params of `sft.init` (an `lm train`/`lm sft` workdir or an `lm export`),
keeps its model config and tokenizer, and trains on the assistant tokens of `sft.data` with the
shared loop (checkpoints, exact resume, signals, metrics, plot). With model.lora_rank > 0 only
the adapters train: the base is frozen (no gradients, no optimizer state, not in checkpoints).
At the end the held-out conversations (`sft.eval_data`) are answered greedily with the chat
template by the initial and the tuned model, and their exact-match accuracies are reported.
"""

from __future__ import annotations

import json
import math
import pathlib

import jax

from lm import plan
from lm.data.cache import data_cache_dir
from lm.data.pipeline import Source, eval_batches, train_dataset
from lm.data.sft import SftSettings, describe, prepare_sft
from lm.errors import UserError
from lm.eval.answers import answer_accuracy, read_conversations
from lm.eval.during import with_sets
from lm.model.lora import is_adapter
from lm.model.params import merge_trees
from lm.store.load import load_init
from lm.store.meta import save_tokenizer
from lm.train.fit import check_resume, evaluator, fit
from lm.train.losses import sft_loss
from lm.train.metrics import plot_curves, read_metrics
from lm.train.setup import build_run

PACK_FILL = 0.9  # share of a packed row's positions that hold tokens, for steps from epochs


def _settings(config) -> SftSettings:
    s = config.sft
    return SftSettings(seq_len=config.data.seq_len, truncation=s.truncation, train_on=s.train_on,
                       on_bad_record=s.on_bad_record, max_skipped_fraction=s.max_skipped_fraction)


def steps_for_epochs(stats: dict, epochs: float, batch_size: int, seq_len: int) -> int:
    """Steps that show the data about `epochs` times: predictions / (rows per step * filled positions)."""
    return max(1, math.ceil(epochs * stats["total_tokens"] / (batch_size * seq_len * PACK_FILL)))


def sft(config, workdir, resume: bool = False, show_progress: bool = True) -> dict:
    workdir, s, t, e = pathlib.Path(workdir), config.sft, config.train, config.eval
    if not s.data:
        raise UserError("sft.data is empty; give --data train.jsonl (chat or instruction JSONL)")
    check_resume(workdir / "checkpoints", resume, total_steps=2**62)  # before any data work
    loaded = load_init(s.init)
    tok = loaded.tokenizer
    cache = data_cache_dir(config.data)
    train = prepare_sft(s.data, tok, _settings(config), cache)
    print(f"sft data {s.data}: {describe(train.stats)}")
    heldout = prepare_sft(s.eval_data, tok, _settings(config), cache) if s.eval_data else None
    if s.epochs > 0:
        config.train.steps = steps_for_epochs(train.stats, s.epochs, t.batch_size, config.data.seq_len)
    finished = check_resume(workdir / "checkpoints", resume, t.steps)
    if finished is not None:
        return {"step": finished, "nothing_to_do": True, "stopped_by": None, "eval_loss": None}
    lora = config.model.lora_rank > 0
    run = build_run(config, sft_loss, trainable=is_adapter if lora else None)
    run.check_batch(t.batch_size, t.micro_batches)
    run.check_batch(e.batch_size, 1, key="eval.batch_size")
    is_main = jax.process_index() == 0
    workdir.mkdir(parents=True, exist_ok=True)
    if is_main:
        (workdir / "config.json").write_text(config.to_json(indent=2))
        (workdir / "data_stats.json").write_text(json.dumps({"train": train.stats} |
                                                            ({"heldout": heldout.stats} if heldout else {}), indent=2))
        save_tokenizer(tok, workdir)
    # The frozen base comes from --init on every start, a resume included; a full fine-tune's
    # fresh state is only built when there is no checkpoint to restore.
    state0, frozen = run.init(base=loaded.params) if (lora or not resume) else (None, None)
    signature = run.signature()
    placer = run.placer(signature)
    data_iter = iter(train_dataset([Source(s.data, train, 1.0)], seq_len=config.data.seq_len,
                                   global_batch=t.batch_size, seed=t.seed, rows=placer.rows))
    evaluate = None
    if heldout is not None:
        eval_signature = run.signature(e.batch_size)
        batches = eval_batches([Source(s.eval_data, heldout, 1.0)], seq_len=config.data.seq_len,
                               batch_size=e.batch_size, n_batches=e.batches)
        evaluate = evaluator(run.eval_step(eval_signature), batches, run.placer(eval_signature), frozen)
    first_row = {"params": plan.param_count(config.model), "trainable_params": _count(run.abstract_state().params),
                 **{f"data/{k}": v for k, v in train.stats.items()}}
    evaluate = with_sets(evaluate, e, run.built, tok, frozen)
    state, last = fit(run, workdir, data_iter, resume=resume, init=lambda: state0, evaluate=evaluate,
                      first_row=first_row, frozen=frozen, signature=signature, show_progress=show_progress)
    if last["stopped_by"]:
        return {"step": last["stop_step"], "stopped_by": last["stopped_by"], "eval_loss": None}
    return _finish(config, workdir, run, loaded, merge_trees(state.params, (frozen or {}).get("base")), last,
                   train.stats, is_main)


def _count(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


SUMMARY_KEYS = ("loss", "eval_loss", "tokens_per_s", "run_tokens_per_s", "run_mfu", "peak_flops_source", "compile_s")


def _finish(config, workdir, run, loaded, params, last: dict, stats: dict, is_main: bool) -> dict:
    """Plot, held-out answers of the initial and the tuned model, summary and table."""
    summary = {"step": config.train.steps, "init": config.sft.init, "lora_rank": config.model.lora_rank,
               "data": stats} | {k: last.get(k) for k in SUMMARY_KEYS}
    if config.sft.eval_data:
        conversations = read_conversations(config.sft.eval_data, config.sft.eval_examples)
        before = answer_accuracy(loaded.config, loaded.params, loaded.tokenizer, conversations,
                                 config.sft.eval_max_new_tokens)
        after = answer_accuracy(config, params, loaded.tokenizer, conversations, config.sft.eval_max_new_tokens)
        summary |= {"exact_match_init": before["exact_match"], "exact_match": after["exact_match"],
                    "exact_match_n": after["n"], "answers": after["examples"]}
        first = _first_eval(workdir)
        summary["eval_loss_init"] = first
        print(table([("init", first, before["exact_match"]), ("sft", last.get("eval_loss"), after["exact_match"])],
                    after["n"]))
    if is_main:
        plot_curves(workdir / "metrics.jsonl", workdir / "loss.png")
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _first_eval(workdir) -> float | None:
    rows = [r for r in read_metrics(workdir / "metrics.jsonl") if r.get("step") == 0 and "eval_loss" in r]
    return rows[0]["eval_loss"] if rows else None


def table(rows, n: int) -> str:
    """model | held-out response loss | exact match, as aligned text."""
    lines = [f"{'model':<12} {'response loss':>14} {'exact match':>12}   ({n} held-out prompts, greedy)"]
    for name, loss, acc in rows:
        loss_text = f"{loss:.4f}" if isinstance(loss, float) else "-"
        lines.append(f"{name:<12} {loss_text:>14} {acc:>11.1%}")
    return "\n".join(lines)
