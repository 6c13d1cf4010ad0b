"""`lm` command line: thin verbs over the library. User errors print one line, exit 2."""

from __future__ import annotations

import argparse
import os
import sys

from lm.errors import UserError


def _split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separates `--config.a.b=v` (or `--config.a.b v`) overrides from the other arguments."""
    rest, overrides, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--config."):
            item = arg[len("--config."):]
            if "=" not in item:
                if i + 1 >= len(argv):
                    raise UserError(f"override '{arg}' has no value; write {arg}=VALUE")
                item, i = f"{item}={argv[i + 1]}", i + 1
            overrides.append(item)
        else:
            rest.append(arg)
        i += 1
    return rest, overrides


OVERRIDES_HELP = """config overrides:
  any key of the config can be set after the other arguments as --config.SECTION.KEY=VALUE
  (or --config.SECTION.KEY VALUE), e.g. --config.optim.lr=1e-3 --config.mesh.fsdp=2
  --config.data.corpus=/path/to/texts; every key, its default and type: lm/config.py base_config().
  Unknown keys and wrong types stop with the dotted key and what was expected."""


def _finetune_args(p, data: str, eval_data: str) -> None:
    p.add_argument("--init", required=True, help="an `lm train`/`lm sft` workdir or an `lm export` to start from")
    p.add_argument("--data", required=True, help=data)
    p.add_argument("--eval-data", help=eval_data)
    p.add_argument("--workdir", required=True, help="directory for checkpoints, metrics, plots")
    p.add_argument("--config", help="a config file whose get_config() sets some keys (default: built-in "
                                    "fine-tuning defaults, lm/config.py FINETUNE_DEFAULTS)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --workdir")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")


def _with_overrides(sub, name: str, **kw):
    return sub.add_parser(name, epilog=OVERRIDES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter, **kw)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lm", description="Train language models end to end.")
    sub = p.add_subparsers(dest="verb", required=True)
    t = _with_overrides(sub, "train", help="pretrain a model (default: tiny model on the Python standard library)")
    t.add_argument("--config", default="configs/tiny.py", help="a Python config file with get_config()")
    t.add_argument("--workdir", required=True, help="directory for checkpoints, metrics, plots")
    t.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --workdir")
    t.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
    t.add_argument("--distributed", action="store_true",
                   help="multi-host: call jax.distributed.initialize() (auto-detects TPU pods, Slurm, ...)")
    t.add_argument("--coordinator", help="with --distributed: host:port of process 0 (else auto-detected)")
    t.add_argument("--num-processes", type=int, help="with --distributed: number of processes")
    t.add_argument("--process-id", type=int, help="with --distributed: this process's index")
    ft = _with_overrides(sub, "sft", help="fine-tune a trained model on conversations (JSONL), fully or with LoRA",
                         description="Supervised fine-tuning on the assistant turns of chat or instruction JSONL, "
                                     "starting from a run or an export. LoRA: --config.model.lora_rank=8.")
    _finetune_args(ft, data='JSONL: {"messages": [...]} or {"instruction", "output"} lines',
                   eval_data="held-out JSONL: response loss during training, exact match at the end")
    po = _with_overrides(sub, "dpo", help="preference-tune a trained model on pairs (DPO, IPO, SimPO), fully or with LoRA",
                         description="Direct preference optimisation from a run or an export (usually an `lm sft` "
                                     "run). Loss: --config.dpo.loss=sigmoid|ipo|simpo, --config.dpo.beta; reference "
                                     "held live or precomputed: --config.dpo.reference=live|precomputed.")
    _finetune_args(po, data='JSONL pairs: {"prompt": TEXT or MESSAGES, "chosen": TEXT, "rejected": TEXT}',
                   eval_data="held-out pairs: DPO metrics (rewards/accuracies, margins, ...) at every eval")
    po.add_argument("--eval-answers", help="held-out conversations (chat JSONL) answered greedily at the end: "
                                           "exact match of the init and the tuned model")
    rw = _with_overrides(sub, "reward", help="train a Bradley-Terry reward model on pairs; `lm reward score` scores texts",
                         description="A scalar head on a trained model's trunk, trained on preference pairs. "
                                     "Score with: lm reward score --workdir RUN (--pairs FILE | --texts FILE).")
    _finetune_args(rw, data='JSONL pairs: {"prompt", "chosen", "rejected"[, "margin"]}',
                   eval_data="held-out pairs: accuracy and mean margin at every eval")
    rl = _with_overrides(sub, "rl", help="RL from rewards (GRPO, PPO) on prompts, sampling with the KV cache",
                         description="Reinforcement learning from a run or an export (usually an `lm sft` run): each "
                                     "step samples --config.rl.group_size responses per prompt, scores them "
                                     "(--config.rl.rewards=module:function or file.py:function, "
                                     "--config.rl.reward_model=REWARD_RUN) and updates the policy. "
                                     "--config.rl.algo=grpo|ppo, --config.rl.beta (KL to the init model).")
    _finetune_args(rl, data='JSONL prompts: {"prompt": TEXT or MESSAGES, ...} or {"messages": [...]} lines; '
                            "the other keys reach the reward functions",
                   eval_data="held-out prompts: mean reward of greedy answers at every eval")
    rl.add_argument("--rewards", help="reward functions, e.g. 'lm.data.synthetic:sort_reward' or "
                                      "'my_rewards.py:score=0.5,other.py:fmt' (sets rl.rewards)")
    rl.add_argument("--reward-model", help="an `lm reward` run or export scoring the responses (sets rl.reward_model)")
    rl.add_argument("--eval-answers", help="held-out conversations (chat JSONL) answered greedily at the end: "
                                           "exact match of the init and the tuned model")
    dm = _with_overrides(sub, "demo", help="the whole pipeline on the tiny model, printing what each stage gained",
                         description="Pretrains the tiny model on the Python standard library, then fine-tunes it "
                                     "(fully and with LoRA) on a generated sort task, then trains DPO and a reward model "
                                     "on its preference pairs and GRPO on its prompts; prints one evidence table. "
                                     "Overrides apply to the pretraining config.")
    dm.add_argument("--workdir", required=True, help="directory for every stage's run")
    dm.add_argument("--no-progress", action="store_true", help="no progress bars (logs only)")
    tk = sub.add_parser("tokenizer", help="train a sentencepiece BPE tokenizer on a corpus")
    tk.add_argument("action", choices=["train"])
    tk.add_argument("--corpus", default="stdlib", help="'stdlib', a directory or a glob (train split only)")
    tk.add_argument("--out", required=True, help="output prefix: writes PREFIX.model and PREFIX.vocab")
    tk.add_argument("--vocab-size", type=int, default=8192)
    tk.add_argument("--max-bytes", type=int, default=50_000_000, help="cap on training text")
    tk.add_argument("--heldout-fraction", type=float, default=0.02, help="as data.heldout_fraction")
    ex = sub.add_parser("export", help="write the params of a training checkpoint (orbax dir or .safetensors)")
    ex.add_argument("--workdir", required=True, help="the `lm train` workdir holding checkpoints/")
    ex.add_argument("--step", type=int, help="which checkpoint (default: the newest)")
    ex.add_argument("--out", required=True, help="a directory (orbax) or a file ending in .safetensors")
    ex.add_argument("--format", choices=["orbax", "safetensors"], help="default: from the --out suffix")
    ex.add_argument("--merge", action="store_true",
                    help="a LoRA run: fold the adapters into their base and export a plain model (default: the "
                         "adapters alone, which `lm sample` folds into the base named in their config)")
    tz = sub.add_parser("tokenize", help="tokenize a corpus into train / held-out token shards")
    tz.add_argument("--corpus", default="stdlib", help="'stdlib', a directory or a glob of text or JSONL(.gz) files")
    tz.add_argument("--out", required=True, help="output directory: writes OUT/train and OUT/heldout")
    tz.add_argument("--tokenizer", default="byte", help="'byte' or a sentencepiece .model file")
    tz.add_argument("--heldout-fraction", type=float, default=0.02, help="as data.heldout_fraction")
    tz.add_argument("--max-bytes", type=int, default=0, help="cap on train input (whole files; 0 = all)")
    tz.add_argument("--workers", type=int, default=0, help="tokenizing processes (0 = all cores)")
    tz.add_argument("--no-progress", action="store_true", help="no progress bar")
    cu = _with_overrides(sub, "curate", help="dedup, filter, language-id and redact raw text into JSONL.gz shards")
    cu.add_argument("--input", action="append", required=True,
                    help="a file, directory or glob (.txt/.py/any text, .jsonl[.gz|.zst], .parquet) or 'stdlib'; repeatable")
    cu.add_argument("--out", required=True, help="output directory: part-*.jsonl.gz shards and report.json")
    cu.add_argument("--config", default="configs/tiny.py", help="a config file; its `curate` section is used")
    cu.add_argument("--workers", type=int, default=1, help="parallel processes")
    cu.add_argument("--no-progress", action="store_true", help="no progress bar")
    pl = _with_overrides(sub, "plan", help="params, FLOPs and memory of a config")
    pl.add_argument("--config", default="configs/tiny.py")
    pl.add_argument("--compile", action="store_true",
                    help="also compile the train step ahead of time on the mesh (nothing is allocated)")
    pl.add_argument("--devices", type=int, default=0,
                    help="plan for this many devices (a -1 mesh axis takes what is left); with --compile, "
                         "simulate them as CPU devices (for meshes larger than this machine)")
    from lm.eval.cli import add_parser as add_eval_parser
    from lm.eval.contamination_cli import add_parser as add_contamination_parser
    from lm.eval.harness_cli import add_parser as add_harness_parser
    from lm.infer.cli import add_parser as add_sample_parser
    from lm.infer.score_cli import add_parser as add_score_parser

    add_sample_parser(sub)
    add_score_parser(sub)
    add_eval_parser(sub)
    add_contamination_parser(sub)
    add_harness_parser(sub)
    return p


def _tokenizer(args) -> int:
    from lm.data.prepare import train_corpus_tokenizer

    tok = train_corpus_tokenizer(args.corpus, args.heldout_fraction, args.out, args.vocab_size, args.max_bytes)
    print(f"wrote {tok.path} ({tok.vocab_size} pieces, {tok.fingerprint()}); trained on {tok.train_stats}")
    print(f"use it with --config.data.tokenizer={tok.path} (model.vocab_size must be >= {tok.vocab_size})")
    return 0


def _tokenize(args) -> int:
    from lm.data.shards import tokenize_corpus

    manifests = tokenize_corpus(args.corpus, args.out, args.tokenizer, args.heldout_fraction,
                                max_train_bytes=args.max_bytes, workers=args.workers, progress=not args.no_progress)
    for split, m in manifests.items():
        print(f"{split}: {m['n_docs']:,} docs, {m['n_tokens']:,} tokens ({m['dtype']}) from {m['n_bytes']:,} bytes "
              f"in {len(m['shards'])} shard(s); skipped {m['skipped']}")
    print(f"use it with --config.data.sources={args.out} --config.data.tokenizer={args.tokenizer}")
    return 0


def _curate(config, args) -> int:
    from pathlib import Path

    from lm.data.curate import curate

    report = curate(args.input, Path(args.out), config.curate, workers=args.workers, progress=not args.no_progress)
    print(f"kept {report['kept']['docs']:,} of {report['in']['docs']:,} documents; "
          f"wrote {len(report['shards'])} shard(s) and report.json to {args.out}")
    return 0


def _plan(config, args) -> int:
    from lm import plan

    print(plan.summary(config.model, config.data.seq_len))
    if args.devices:  # must happen before jax is first imported
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    fsdp, tensor = config.mesh.fsdp, config.mesh.tensor
    if args.devices:
        from lm.sharding import mesh_shape

        _, fsdp, tensor = mesh_shape(config.mesh, args.devices)
    if fsdp > 0 and tensor > 0:  # a -1 among them takes what is left of --devices
        print(plan.memory_summary(config.model, fsdp=fsdp, tensor=tensor))
    if args.compile:
        from lm.aot import compile_train_step

        figures = compile_train_step(config)
        micro_rows = config.train.batch_size // config.train.micro_batches
        rows = max(1, micro_rows // (figures["mesh"]["data"] * figures["mesh"]["fsdp"]))
        print(plan.compile_report(figures, config.model, config.data.seq_len, rows))
    return 0


def _export(args) -> int:
    from lm.store.export import export_params

    done = export_params(args.workdir, args.out, args.step, args.format, merge=args.merge)
    print(f"wrote {done['params']:,} params of step {done['step']} to {done['out']} ({done['format']}); "
          "read them with lm.store.load.load_params")
    return 0


SECTIONS = {"sft": "sft", "dpo": "pairs", "reward": "pairs", "rl": "rl"}  # verb -> config section of its init/data


def _finetune(args, overrides: list[str], argv: list[str]) -> int:
    from pathlib import Path

    from lm.config import finetune_config
    from lm.store.meta import init_config

    if not Path(args.init).exists():
        raise UserError(f"--init {args.init}: no such file or directory; expected an `lm train`/`lm sft` "
                        "workdir or an `lm export`")
    init = str(Path(args.init).absolute())  # the run records where its base lives
    keys = {"init": init, "data": args.data, "eval_data": args.eval_data}
    for name in ("eval_answers", "rewards", "reward_model"):
        if getattr(args, name, None):
            keys[name] = getattr(args, name)
    config = finetune_config(init_config(init), args.config, overrides, SECTIONS[args.verb], **keys)
    from lm.cpu_flags import apply_cpu_defaults

    apply_cpu_defaults(config.model.compute_dtype)  # before anything imports jax
    if args.verb == "sft":
        from lm.train.sft import sft as stage
    elif args.verb == "dpo":
        from lm.train.dpo import dpo as stage
    elif args.verb == "rl":
        from lm.train.rl import rl as stage
    else:
        from lm.train.reward import reward as stage
    summary = stage(config, args.workdir, resume=args.resume, show_progress=not args.no_progress)
    if summary.get("stopped_by"):
        return _stopped(summary, argv)
    if summary.get("nothing_to_do"):
        print(f"lm: {args.workdir} already finished at step {summary['step']}; nothing left to do", file=sys.stderr)
        return 0
    plot = "rl.png" if args.verb == "rl" else "loss.png"
    print(f"done: step {summary['step']}; see {args.workdir}/summary.json and {plot}")
    return 0


def _stopped(summary: dict, argv: list[str]) -> int:
    """A signal ended the run after a checkpoint: say how to continue; exit 0 (nothing was lost)."""
    import shlex

    again = shlex.join(a for a in argv if a != "--resume")
    print(f"lm: stopped by {summary['stopped_by']} at step {summary['step']}; checkpoint saved. "
          f"Continue with: lm {again} --resume", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        rest, overrides = _split_overrides(argv)
        if rest[:2] == ["reward", "score"]:  # `lm reward score`: its own parser
            rest = ["reward-score", *rest[2:]]
        args = _parser().parse_args(rest)
        if args.verb == "tokenizer":
            return _tokenizer(args)
        if args.verb == "tokenize":
            return _tokenize(args)
        if args.verb == "export":
            return _export(args)
        if args.verb == "sample":
            from lm.infer.cli import run as sample

            return sample(args)
        if args.verb == "eval":
            from lm.eval.cli import run as evaluate

            return evaluate(args, overrides)
        if args.verb == "harness":
            from lm.eval.harness_cli import run as harness

            return harness(args)
        if args.verb == "contamination":
            from lm.eval.contamination_cli import run as contamination

            return contamination(args)
        if args.verb == "reward-score":
            from lm.infer.score_cli import run as score

            return score(args)
        if args.verb in SECTIONS:
            return _finetune(args, overrides, argv)
        if args.verb == "demo":
            from lm.cpu_flags import apply_cpu_defaults
            from lm.demo import run_demo

            apply_cpu_defaults("float32")  # before anything imports jax (the tiny model is float32)
            run_demo(args.workdir, show_progress=not args.no_progress, pretrain_overrides=overrides)
            return 0
        from lm.config import load_config

        config = load_config(args.config, overrides)
        from lm.cpu_flags import apply_cpu_defaults

        apply_cpu_defaults(config.model.compute_dtype)  # before anything imports jax
        if args.verb == "plan":
            return _plan(config, args)
        if args.verb == "curate":
            return _curate(config, args)
        if args.distributed:
            import jax

            jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
        from lm.train.pretrain import train

        summary = train(config, args.workdir, resume=args.resume, show_progress=not args.no_progress)
        if summary.get("stopped_by"):
            return _stopped(summary, argv)
        if summary.get("nothing_to_do"):
            print(f"lm: {args.workdir} already finished at step {summary['step']} (train.steps="
                  f"{config.train.steps}); nothing left to do, no file was changed. To train further, "
                  "raise --config.train.steps", file=sys.stderr)
            return 0
        if summary["eval_loss"] is not None:
            print(f"done: step {summary['step']}, held-out loss {summary['eval_loss']:.4f} "
                  f"(unigram baseline {summary['unigram_baseline']:.4f}); see {args.workdir}/loss.png")
        return 0
    except UserError as e:
        print(f"lm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lm: interrupted", file=sys.stderr)
        return 130


def run() -> None:
    """The `lm` console script: huge-page malloc for the step's temporaries (lm.hugepages), then main."""
    from lm.hugepages import reexec_with_hugepages

    reexec_with_hugepages()
    sys.exit(main())


if __name__ == "__main__":
    run()
