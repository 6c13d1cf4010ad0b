"""`lm demo`: the whole pipeline on the tiny model, with the evidence that each stage helped.

1. pretraining on the Python standard library under the default recipe (Muon, warmup-stable-decay,
   QK-norm), beside the same run under the old one (AdamW, warmup + cosine): held-out loss against
   each other and the unigram baseline, both curves in one plot;
2. the sort task (lm.data.synthetic) as chat JSONL, with a held-out split;
3. supervised fine-tuning from the pretrained model, fully and with LoRA adapters;
4. preference pairs of the task (the answer vs a plausible wrong one), DPO from the SFT model,
   and a reward model trained on the same pairs;
5. GRPO from the SFT model on the task's prompts, rewarded for the exact answer;
6. distillation of the GRPO model into a student of half the width (pretrained the same way),
   beside the same student trained by SFT alone on the same data and steps;
7. the rest of post-training (lm.demo.posttrain): KTO from the SFT model on the pairs split into
   unpaired examples, ORPO from the pretrained model on the pairs, rejection-sampling fine-tuning
   from the SFT model with the task's verifier, and QLoRA SFT over the pretrained model in NF4;
8. `lm eval` of every model on the same tasks (held-out bits per byte of the pretraining text,
   exact match on the task) and a 13-gram contamination check of the task's held-out split;
9. the GRPO model exported as a Hugging Face checkpoint, reloaded by transformers, answering 16
   held-out prompts greedily as `lm sample --chat` does;
10. serving (lm.demo.serve): the GRPO model behind `lm serve`'s OpenAI API answering held-out
   prompts from 16 concurrent clients, quantized to int8 and int4, and decoded speculatively with
   the distilled student (and prompt lookup) as drafts;
11. a mixture of experts (lm.demo.moe): the tiny model with 8 experts of half the MLP width, 2 per
   token (the dense model's active FLOPs), pretrained for 50 steps on the same batches, its
   held-out loss against the dense pretraining's at step 50, and its routing balance;
12. tool use and asynchronous RL (lm.demo.agent): multi-digit multiplication as chat
   (lm.data.arithmetic), SFT from the pretrained model on conversations with the calculator
   offered and without tools, then GRPO through the calculator environment; held-out exact match
   with bootstrap intervals without the tool, with it, and after GRPO; and the sort task's GRPO
   run beside the same run with rollouts sampled 1 and 2 steps ahead (rl.max_staleness): steps
   per second, the learner's time waiting for rollouts, held-out reward curves in one plot;
13. parallelism (lm.demo.scale): 1F1B, interleaved 1F1B, ring attention on 8 simulated devices vs one;
14. one table: held-out response loss and exact-match accuracy of greedy answers, base vs SFT
   vs SFT-LoRA vs DPO vs GRPO vs the half-width students, then the preference evidence on held-out pairs and the RL
   reward and KL (lm.demo.evidence); written to WORKDIR/demo_summary.json as well.
"""

from __future__ import annotations

import json
import pathlib

from lm.config import load_config
from lm.data.synthetic import write_sort_pairs, write_sort_task
from lm.demo.agent import staleness_runs, tool_use
from lm.demo.evidence import evidence, recipe_comparison
from lm.demo.moe import moe_pretraining
from lm.demo.posttrain import MODELS as POST_MODELS
from lm.demo.posttrain import post_training
from lm.demo.scale import parallel_runs
from lm.demo.serve import serving
from lm.store.meta import init_config
from lm.train.finetune import finetune_config

PRETRAIN_CONFIG, SFT_CONFIG, PAIRS_CONFIG = "configs/tiny.py", "configs/sft_tiny.py", "configs/pairs_tiny.py"
RL_CONFIG = "configs/rl_tiny.py"
REWARD = ["optim.lr=1e-3"]
ANSWERS = ["finetune.eval_max_new_tokens=16"]  # the sort task's answers are short: held-out exact match
LORA = ["model.lora_rank=8", "model.lora_alpha=16.0", "optim.lr=1e-2", "finetune.epochs=1.5"]
HALF = ["model.d_model=64", "model.d_ff=192"]  # the distillation student: half the tiny model's width
DISTILL = ["distill.divergence=forward_kl", "distill.temperature=1.0"]
PRETRAIN_EVAL = ["eval.every_steps=50"]  # the held-out loss at step 50 too: the MoE stage's comparison
OLD_RECIPE = ["optim.optimizer=adamw", "optim.schedule=cosine", "model.qk_norm=false"]  # the default until Muon


def _stage(title: str) -> None:
    print(f"\n=== {title} ===", flush=True)


class _Stages:
    """The demo's stages as they start. The one in progress names a stop; no stage starts once a
    signal came (each start is a safe point of lm.train.faults.StopSignal). With `resume`, a
    training stage whose run finished (its summary.json) is read back instead of trained again,
    and one stopped part-way resumes from its newest checkpoint."""

    def __init__(self, stop, resume: bool, show_progress: bool):
        self.stop, self.resume, self.show_progress, self.current = stop, resume, show_progress, None

    def start(self, number: int, name: str, title: str) -> None:
        self.stop.enter(f"demo stage {number} ({name})")
        self.current = self.stop.phase
        _stage(f"{number}. {title}")

    def train(self, fn, config, workdir) -> dict:
        """`fn(config, workdir, ...)`, a training stage; a stop in its loop stops the demo."""
        from lm.store.checkpoint_read import saved_steps
        from lm.verb import Stopped

        workdir = pathlib.Path(workdir)
        if self.resume and (done := finished_run(workdir)) is not None:
            print(f"{workdir}: finished by an earlier run; reusing its summary")
            return done
        resume = self.resume and bool(saved_steps(workdir / "checkpoints"))
        out = fn(config, workdir, resume=resume, show_progress=self.show_progress)
        if out.get("stopped_by"):
            raise Stopped(out["stopped_by"], out["step"], self.current)
        return out


def finished_run(workdir: pathlib.Path) -> dict | None:
    """The summary of a run that finished (written last, whole: lm.train.stage), or None."""
    try:
        return json.loads((pathlib.Path(workdir) / "summary.json").read_text())
    except (OSError, ValueError):
        return None


def run_demo(
    workdir,
    show_progress: bool = True,
    pretrain_overrides=(),
    sft_overrides=(),
    pair_overrides=(),
    rl_overrides=(),
    n_train: int = 20000,
    n_heldout: int = 256,
    n_pairs: int = 4000,
    resume: bool = False,
) -> dict:
    """Runs every stage into `workdir`; returns the summary. SIGTERM/SIGINT stop the stage in progress
    cleanly (a training stage with its checkpoint) and start no later stage: `lm.verb.Stopped`
    says where; `resume=True` then skips the finished training stages and resumes the stopped one."""
    from lm.train.faults import StopRequested, StopSignal
    from lm.verb import Stopped

    with StopSignal("the demo", defer=False, saved=False) as stop:  # the command's own under lm.cli
        stages = _Stages(stop, resume, show_progress)
        try:
            return _run_stages(
                stages,
                pathlib.Path(workdir),
                pretrain_overrides,
                sft_overrides,
                pair_overrides,
                rl_overrides,
                n_train,
                n_heldout,
                n_pairs,
            )
        except Stopped:
            raise
        except StopRequested as e:
            raise Stopped(e.by, None, stages.current, "the finished stages are kept") from None
        except Exception as e:  # whatever broke once a signal came is the signal's doing
            if stop.received is None:
                raise
            raise Stopped(stop.received, None, stages.current, "the finished stages are kept") from e


def _run_stages(
    stages: _Stages,
    root: pathlib.Path,
    pretrain_overrides,
    sft_overrides,
    pair_overrides,
    rl_overrides,
    n_train: int,
    n_heldout: int,
    n_pairs: int,
) -> dict:
    from lm.train.distill import distill
    from lm.train.dpo import dpo  # lazy: jax after the CPU flags are set
    from lm.train.pretrain import train
    from lm.train.reward import reward
    from lm.train.rl import rl
    from lm.train.sft import sft

    base_dir, task_dir = root / "pretrain", root / "task"
    stages.start(1, "pretraining", "pretraining on the Python standard library")
    base = stages.train(train, load_config(PRETRAIN_CONFIG, [*PRETRAIN_EVAL, *pretrain_overrides]), base_dir)
    stages.start(1, "pretraining, old recipe", "the same pretraining under the old recipe: AdamW, warmup + cosine")
    old_dir = root / "pretrain-adamw"
    old = stages.train(train, load_config(PRETRAIN_CONFIG, [*PRETRAIN_EVAL, *OLD_RECIPE, *pretrain_overrides]), old_dir)
    base["old_recipe"] = recipe_comparison(base_dir, old_dir, old)
    stages.start(2, "the sort task", "the sort task: 'sort 70931' -> '01379'")
    paths = write_sort_task(task_dir, n_train=n_train, n_heldout=n_heldout)
    print(f"wrote {n_train} training and {n_heldout} held-out conversations to {task_dir}")
    runs = {}
    for name, extra in (("sft", []), ("sft-lora", LORA)):
        stages.start(3, name, f"supervised fine-tuning ({name})")
        config = finetune_config(
            init_config(str(base_dir.absolute())),
            SFT_CONFIG,
            [*extra, *sft_overrides],
            init=str(base_dir.absolute()),
            data=str(paths["train"]),
            eval_data=str(paths["heldout"]),
        )
        runs[name] = stages.train(sft, config, root / name)
    stages.start(4, "preference pairs", "preference pairs: the answer vs a plausible wrong one")
    pair_paths = write_sort_pairs(task_dir, n_train=n_pairs, n_heldout=n_heldout)
    sft_dir = str((root / "sft").absolute())
    keys = dict(init=sft_dir, data=str(pair_paths["train"]), eval_data=str(pair_paths["heldout"]))
    stages.start(5, "dpo", "DPO from the SFT model")
    config = finetune_config(
        init_config(sft_dir),
        PAIRS_CONFIG,
        [*ANSWERS, *pair_overrides],
        "dpo",
        eval_answers=str(paths["heldout"]),
        **keys,
    )
    preference = {"dpo": stages.train(dpo, config, root / "dpo")}
    stages.start(6, "reward", "a reward model from the SFT model")
    config = finetune_config(init_config(sft_dir), PAIRS_CONFIG, [*REWARD, *pair_overrides], "reward", **keys)
    preference["reward"] = stages.train(reward, config, root / "reward")
    stages.start(7, "grpo", "GRPO from the SFT model: reward 1 for the exact answer")
    config = finetune_config(
        init_config(sft_dir),
        RL_CONFIG,
        list(rl_overrides),
        "rl",
        init=sft_dir,
        data=str(paths["train"]),
        eval_data=str(paths["heldout"]),
        eval_answers=str(paths["heldout"]),
    )
    grpo = stages.train(rl, config, root / "grpo")
    stages.start(8, "distillation", "distillation: the GRPO model into a student of half the width, beside SFT alone")
    half = stages.train(train, load_config(PRETRAIN_CONFIG, [*HALF, *pretrain_overrides]), root / "pretrain-half")
    half_dir, grpo_dir = str((root / "pretrain-half").absolute()), str((root / "grpo").absolute())
    student = dict(init=half_dir, data=str(paths["train"]), eval_data=str(paths["heldout"]))
    sft_half = stages.train(
        sft, finetune_config(init_config(half_dir), SFT_CONFIG, list(sft_overrides), **student), root / "sft-half"
    )
    config = finetune_config(
        init_config(half_dir),
        SFT_CONFIG,
        [*DISTILL, f"distill.teacher={grpo_dir}", *sft_overrides],
        "distill",
        **student,
    )
    distilled = stages.train(distill, config, root / "distilled")
    post = post_training(stages, root, paths, pair_paths, sft_overrides, pair_overrides)
    summary = _summary(base, runs, preference, grpo, root)
    summary["post"] = post | {"sft-lora": runs["sft-lora"]}
    summary["sft"] |= {
        "sft-half": _row(sft_half),
        "distilled": _row(distilled) | {"response_loss": distilled.get("eval_nll")},
    }
    summary["distill"] = {
        "student_pretrain_eval_loss": half.get("eval_loss"),
        "steps": distilled.get("step"),
        "top1_agreement": distilled.get("eval_top1_agreement"),
        "response_loss": distilled.get("eval_nll"),
        "exact_match": distilled.get("exact_match"),
    }
    stages.start(10, "evaluation", "evaluation of every model: held-out bits per byte, exact match, contamination")
    summary["eval"] = evaluate_all(root, paths)
    stages.start(11, "export", "the GRPO model as a Hugging Face checkpoint, reloaded by transformers")
    summary["hf"] = export_and_reload(root / "grpo", root / "grpo-hf", paths["heldout"])
    stages.start(12, "TPU plan", "the pretraining step compiled for a TPU v5e-4 slice ahead of time (no TPU needed)")
    summary["tpu"] = plan_for_tpu(load_config(PRETRAIN_CONFIG, list(pretrain_overrides)), "v5e-4")
    stages.start(13, "serving", "serving: the GRPO model behind the OpenAI API, quantized, speculative decoding")
    summary["serve"] = serving(root, paths["heldout"])
    stages.start(
        14, "mixture of experts", "a mixture of experts at the dense model's active FLOPs, beside the dense pretraining"
    )
    summary["moe"] = moe_pretraining(root, base_dir, show_progress=stages.show_progress, resume=stages.resume)
    stages.start(15, "tool use", "tool use: multiplication with a calculator, SFT then GRPO through the environment")
    summary["agent"] = tool_use(stages, root / "agent", base_dir)
    stages.start(16, "asynchronous GRPO", "asynchronous GRPO on the sort task: rl.max_staleness 0, 1, 2")
    summary["async_rl"] = staleness_runs(stages, root / "grpo-async", paths, root / "sft", rl_overrides, root / "grpo")
    stages.start(17, "parallelism", "8 simulated devices: 1F1B, interleaved 1F1B and ring attention vs one device")
    summary["scale"] = parallel_runs(root / "scale")
    stages.stop.enter("writing the demo's summary")  # a safe point: a stop in the last stage writes none
    text = evidence(summary, n_heldout)
    print("\n" + text)
    (root / "demo_summary.json").write_text(json.dumps(summary, indent=2))
    (root / "demo_summary.txt").write_text(text + "\n")
    return summary


def plan_for_tpu(config, slice_name: str) -> dict:
    """The demo model's pretraining step compiled by the TPU compiler for a slice, beside the planner."""
    import importlib.util

    from lm.plan.aot import compile_step, target_devices
    from lm.plan.hardware import parse_target
    from lm.plan.memory import estimate

    if importlib.util.find_spec("libtpu") is None:
        print("skipped: the TPU compiler comes with lm[tpu]")
        return {}
    target = parse_target(slice_name)
    compiled = compile_step("pretrain", config, target_devices(target))
    planned = estimate(config, "pretrain", target.chips, chip=target.chip).total
    out = {
        "slice": slice_name,
        "compiled_bytes": compiled.total,
        "planned_bytes": planned,
        "error": compiled.error,
        "compile_s": compiled.compile_s,
        "flops": compiled.flops,
    }
    print(
        f"{slice_name}: the compiler plans {compiled.total / 2**20:.1f} MiB a chip, the planner "
        f"{planned / 2**20:.1f} MiB; {compiled.flops:.3g} FLOPs a chip a step; compiled in {compiled.compile_s:.0f} s"
    )
    return out


def export_and_reload(workdir: pathlib.Path, out: pathlib.Path, heldout, n: int = 16) -> dict:
    """`lm export --format hf` of a run, then transformers' greedy answers against ours."""
    from lm.eval.hf_check import compare_with_transformers
    from lm.store.hf.export import export_hf
    from lm.store.load import load_trained

    done = export_hf(load_trained(workdir=str(workdir), merge_adapters=False), out)
    check = compare_with_transformers(workdir, out, heldout, n=n)
    print(
        f"exported {done['architecture']} to {out}; transformers' greedy answers equal lm's on "
        f"{check['same_answers']} of {check['n']} held-out prompts (chat-template ids equal on "
        f"{check['same_prompt_ids']})"
    )
    return {"architecture": done["architecture"], "out": str(out)} | {k: v for k, v in check.items() if k != "examples"}


def evaluate_all(root: pathlib.Path, paths: dict) -> dict:
    """`lm eval` of the base, SFT, DPO and GRPO models on the same tasks, and a contamination check
    of the task's held-out split against the training data (lm.eval.suite)."""
    from lm.eval import suite
    from lm.eval.contamination import check

    train_shards, heldout_shards = suite.pretraining_shards(root / "pretrain")
    specs = [f"heldout={heldout_shards[0]}?limit={suite.HELDOUT_TOKENS}", f"task={paths['heldout']}"]
    models = {"base": root / "pretrain"} | {name: root / name for name in ("sft", "sft-lora", "dpo", "grpo")}
    models |= {"sft-half": root / "sft-half", "distilled": root / "distilled"}
    models |= {name: root / name for name in POST_MODELS}
    reports = suite.evaluate_models(models, specs, root / "eval")
    # the task's examples are 3 words ("sort 70931" + "01379"): each is checked whole
    found = check(
        [*train_shards, str(paths["train"])],
        [str(paths["heldout"])],
        min_words=3,
        tokenizer=str(root / "pretrain" / "tokenizer.model"),
        progress=False,
    )
    planted = check([str(paths["train"]), str(paths["heldout"])], [str(paths["heldout"])], min_words=3, progress=False)
    task = next(iter(found["tasks"].values()))
    contamination = {
        "n": found["n"],
        "examples": task["examples"],
        "contaminated": task["contaminated"],
        "too_short": task["too_short"],
        "train_mb": found["train"]["bytes"] / 1e6,
        "mb_per_s": found["train"]["mb_per_s"],
        "found_when_planted": next(iter(planted["tasks"].values()))["contaminated"],
    }
    out = suite.summary(reports, "heldout", "task", "sft", contamination)
    out["distilled_vs_sft_half"] = suite.compare(reports["sft-half"], reports["distilled"])["task"].get("exact")
    return out


def _summary(base: dict, runs: dict, preference: dict, grpo: dict, root: pathlib.Path) -> dict:
    """Each stage's figures the evidence table reads (and demo_summary.json keeps)."""
    sft = {
        "base": {"response_loss": runs["sft"].get("eval_loss_init"), "exact_match": runs["sft"].get("exact_match_init")}
    }
    sft |= {name: _row(r) for name, r in runs.items()}
    d = preference["dpo"]
    sft["dpo"] = {
        "response_loss": None,
        "exact_match": d.get("exact_match"),
        "steps": d.get("step"),
        "tokens_per_s": d.get("run_tokens_per_s"),
    }
    sft["grpo"] = {"response_loss": None, "exact_match": grpo.get("exact_match"), "steps": grpo.get("step")}
    rl = {
        k: grpo.get(k)
        for k in (
            "eval_init",
            "eval",
            "reward",
            "kl",
            "response_length",
            "rollout_tokens_per_s",
            "update_tokens_per_s",
            "sampling_share",
        )
    } | {"plot": str(root / "grpo" / "rl.png")}
    return {
        "pretrain": {k: base.get(k) for k in ("eval_loss", "unigram_baseline", "run_tokens_per_s", "old_recipe")},
        "sft": sft,
        "preference": {
            "dpo": {"init": d.get("eval_init"), "tuned": d.get("eval")},
            "reward": {"init": preference["reward"].get("eval_init"), "tuned": preference["reward"].get("eval")},
        },
        "rl": rl,
    }


def _row(r: dict) -> dict:
    return {
        "response_loss": r.get("eval_loss"),
        "exact_match": r.get("exact_match"),
        "steps": r.get("step"),
        "tokens_per_s": r.get("run_tokens_per_s"),
    }
