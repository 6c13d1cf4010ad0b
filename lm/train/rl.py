"""`lm rl`: reinforcement learning from rewards (GRPO or PPO) from a trained model on prompts.

Each step samples responses with the KV-cache sampler, scores them and updates the policy
(lm.train.rl_step); the one loop (lm.train.fit) runs the steps, with held-out greedy rewards
at every eval, checkpoints (the prompt stream's position included: a killed run resumes
exactly), signals and metrics. The reference for the KL is the init model, frozen: a copy in
the compute dtype beside the policy (with LoRA: the base with the adapters off); beta = 0
holds none. PPO puts a value head (lm.model.heads.ScalarHead, zero at the start) on the
policy's trunk. At the end: reward and KL curves (rl.png), and with `rl.eval_answers` the
exact match of the init and the tuned model's greedy answers.
"""

from __future__ import annotations

import functools
import json
import math
import pathlib

import jax

from lm import plan
from lm.data.chat import ChatTemplate
from lm.data.pipeline import Source, train_dataset
from lm.data.prompts import PromptSet, describe, read_prompts
from lm.errors import UserError
from lm.eval.answers import compare_answers
from lm.eval.during import with_sets
from lm.infer.sampling import SamplingParams
from lm.model.lora import is_adapter
from lm.model.params import merge_trees
from lm.model.transformer import Transformer
from lm.store.load import load_init
from lm.store.meta import save_tokenizer
from lm.train import rl_step
from lm.train.fit import check_resume, fit
from lm.train.metrics import json_default, plot_rl
from lm.train.pairs import first_eval
from lm.train.reward import head_or_adapter
from lm.train.rewards import Rewards
from lm.train.rl_losses import RlSettings, rl_loss
from lm.train.rollout import Sampler, Scorer
from lm.train.setup import build_run, reference_slot

SUMMARY_KEYS = ("reward", "kl", "loss", "response_length", "rollout_tokens_per_s", "update_tokens_per_s",
                "sampling_share", "eval_reward", "compile_s")


def build_rl_run(config, devices=None):
    """The run of `lm rl`: the policy (with a value head for PPO), its loss and the reference."""
    r, settings = config.rl, RlSettings.from_config(config.rl)
    rows = r.prompts_per_step * r.group_size
    config.train.batch_size = rows // r.minibatches
    lora = config.model.lora_rank > 0
    model_fn = functools.partial(Transformer, scalar_head=True) if r.algo == "ppo" else Transformer
    trainable = (head_or_adapter if r.algo == "ppo" else is_adapter) if lora else None
    frozen = {"reference": reference_slot(config, lora)} if settings.needs_reference else None
    return build_run(config, lambda m: rl_loss(m, settings), devices=devices, model_fn=model_fn,
                     trainable=trainable, frozen=frozen, updates_per_step=r.epochs * r.minibatches)


def _prompts(path, loaded, config, limit: int = 0) -> PromptSet:
    r = config.rl
    return read_prompts(path, loaded.tokenizer, seq_len=config.data.seq_len, max_new_tokens=r.max_new_tokens,
                        on_bad_record=r.on_bad_record, max_skipped_fraction=r.max_skipped_fraction, limit=limit)


def rl(config, workdir, resume: bool = False, show_progress: bool = True) -> dict:
    r, workdir = config.rl, pathlib.Path(workdir)
    if not r.data:
        raise UserError('rl.data is empty; give `lm rl --data prompts.jsonl` ({"prompt": ...} lines)')
    if jax.process_count() > 1:
        raise UserError("lm rl runs in one process (any number of its devices); multi-host RL is not supported yet")
    finished = check_resume(workdir / "checkpoints", resume, config.train.steps)
    if finished is not None:
        return {"step": finished, "nothing_to_do": True, "stopped_by": None}
    loaded = load_init(r.init)
    prompts = _prompts(r.data, loaded, config)
    print(f"rl prompts {r.data}: {describe(prompts.stats)}")
    heldout = _prompts(r.eval_data, loaded, config, limit=r.eval_prompts) if r.eval_data else None
    rewards = Rewards.from_config(r)
    settings = RlSettings.from_config(r)
    run = build_rl_run(config)
    t = config.train
    run.check_batch(t.batch_size, t.micro_batches)
    _write_run_files(config, workdir, loaded, prompts)

    base = loaded.params
    lora = run.trainable is not None
    state0, frozen = run.init(base=base) if (lora or not resume) else (None, run.frozen_params(base))
    template = ChatTemplate.for_tokenizer(loaded.tokenizer)
    sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p)
    sampler = Sampler(run, sampling, template.stop_ids, config.data.seq_len)
    scorer = Scorer(run, settings.algo == "ppo")
    step = rl_step.RlStep(run, frozen, prompts, rewards, sampler, scorer, template, settings, r)
    data_iter = iter(train_dataset([Source(r.data, prompts, 1.0)], seq_len=config.data.seq_len,
                                   global_batch=r.prompts_per_step, seed=t.seed, pack=False))
    evaluate = rl_step.evaluator(step, heldout, r.eval_prompts, config.eval.batch_size) if heldout else None
    # MFU counts, per token of a rollout row: the updates (epochs x 6N), the scoring pass (2N)
    # and sampling (~2N); the loop's tokens per step are those of one minibatch
    passes = r.epochs + (scorer.active + 1) / 3
    flops = plan.flops_per_token(config.model, config.data.seq_len) * passes * r.minibatches
    first_row = {"trainable_params": sum(math.prod(x.shape) for x in jax.tree.leaves(run.abstract_state().params)),
                 **{f"data/{k}": v for k, v in prompts.stats.items()}}
    evaluate = with_sets(evaluate, config.eval, run.built, loaded.tokenizer, frozen)
    state, last = fit(run, workdir, data_iter, resume=resume, init=lambda: state0, evaluate=evaluate,
                      first_row=first_row, frozen=frozen, signature=step.signature, show_progress=show_progress,
                      flops_per_token=flops, step_fn=step)
    if last["stopped_by"]:
        return {"step": last["stop_step"], "stopped_by": last["stopped_by"]}
    return _finish(config, workdir, loaded, merge_trees(state.params, (frozen or {}).get("base")), last)


def _write_run_files(config, workdir: pathlib.Path, loaded, prompts: PromptSet) -> None:
    if jax.process_index() != 0:
        return
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(config.to_json(indent=2))
    (workdir / "data_stats.json").write_text(json.dumps({"prompts": prompts.stats}, indent=2))
    save_tokenizer(loaded.tokenizer, workdir)


def _finish(config, workdir: pathlib.Path, loaded, params, last: dict) -> dict:
    r = config.rl
    policy = {k: v for k, v in params.items() if k != "scalar_head"}
    summary = {"step": config.train.steps, "init": r.init, "algo": r.algo, "lora_rank": config.model.lora_rank,
               "eval_init": first_eval(workdir), "eval": {k: v for k, v in last.items() if k.startswith("eval_")}}
    summary |= {k: last.get(k) for k in SUMMARY_KEYS}
    if summary["eval"]:
        print(f"held-out greedy reward: init {summary['eval_init'].get('eval_reward', float('nan')):.4f} -> "
              f"tuned {summary['eval'].get('eval_reward', float('nan')):.4f}")
    if r.eval_answers:
        summary |= compare_answers(loaded, config, policy, r.eval_answers, r.eval_examples, r.eval_max_new_tokens)
    if jax.process_index() == 0:
        plot_rl(workdir / "metrics.jsonl", workdir / "rl.png")
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2, default=json_default))
    return summary
