"""`lm train`, `lm sft`, `lm dpo`, `lm reward` (and `lm reward score`), `lm rl`: verbs over the training
stages. Stages are imported inside `run`, after the CPU flags are set from the config."""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable

from lm.errors import UserError
from lm.infer import score_cli
from lm.verb import Stopped, add_distributed, is_main, start_distributed, with_overrides


class Pretrain:
    """`lm train`: pretraining from a config file."""

    @staticmethod
    def add_parser(sub) -> None:
        t = with_overrides(sub, "train", help="pretrain a model (default: tiny model on the Python standard library)")
        t.add_argument("--config", default="configs/tiny.py", help="a Python config file with get_config()")
        t.add_argument("--workdir", required=True, help="directory for checkpoints, metrics, plots")
        t.add_argument("--init", help="continue pretraining a model: an `lm train` workdir, an `lm export` or a "
                                      "Hugging Face model directory (its architecture and tokenizer are used)")
        t.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --workdir")
        t.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
        add_distributed(t)

    @staticmethod
    def run(args, overrides) -> int:
        from lm.config import load_config
        from lm.process.cpu_flags import apply_cpu_defaults

        config = load_config(args.config, overrides)
        if args.init:
            from pathlib import Path

            from lm.store.meta import init_config, tokenizer_source
            from lm.train.finetune import continued_config

            init = str(Path(args.init).absolute())
            start = init_config(init)
            config = continued_config(config, start, init, tokenizer_source(init, start))
        apply_cpu_defaults(config.model.compute_dtype)  # before anything imports jax
        start_distributed(args)
        from lm.train.pretrain import train

        summary = train(config, args.workdir, resume=args.resume, show_progress=not args.no_progress)
        if summary.get("stopped_by"):
            raise Stopped(summary["stopped_by"], summary["step"])
        if summary.get("nothing_to_do"):
            print(f"lm: {args.workdir} already finished at step {summary['step']} (train.steps="
                  f"{config.train.steps}); nothing left to do, no file was changed. To train further, "
                  "raise --config.train.steps", file=sys.stderr)
            return 0
        if summary["eval_loss"] is not None and is_main():
            print(f"done: step {summary['step']}, held-out loss {summary['eval_loss']:.4f} "
                  f"(unigram baseline {summary['unigram_baseline']:.4f}); see {args.workdir}/loss.png")
        return 0


@dataclasses.dataclass(frozen=True)
class FineTune:
    """A verb over a stage that starts from a trained model (--init) and reads JSONL (--data)."""

    name: str
    help: str
    description: str
    data: str  # help of --data
    eval_data: str  # help of --eval-data
    section: str  # the config section of its init and data
    stage: Callable[[], Callable]  # returns the stage function: imported late, jax after the CPU flags
    options: tuple[tuple[str, ...], ...] = ()  # (flag, help[, dotted key]): more keys (default: of its section)
    plot: str = "loss.png"

    def add_parser(self, sub) -> None:
        self.build(sub)

    def build(self, sub):
        """The verb's parser and its required arguments."""
        p = with_overrides(sub, self.name, help=self.help, description=self.description)
        required = [p.add_argument("--init", required=True,
                                   help="an `lm train`/`lm sft` workdir, an `lm export` or a Hugging Face model directory to start from"),
                    p.add_argument("--data", required=True, help=self.data)]
        p.add_argument("--eval-data", help=self.eval_data)
        required.append(p.add_argument("--workdir", required=True, help="directory for checkpoints, metrics, plots"))
        p.add_argument("--config", help="a config file whose get_config() sets some keys (default: built-in "
                                        "fine-tuning defaults, lm/train/finetune.py FINETUNE_DEFAULTS)")
        p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --workdir")
        p.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
        add_distributed(p)
        for flag, text, *_ in self.options:
            p.add_argument(flag, help=text)
        return p, required

    def run(self, args, overrides) -> int:
        from pathlib import Path

        from lm.train.finetune import finetune_config
        from lm.process.cpu_flags import apply_cpu_defaults
        from lm.store.meta import init_config

        if not Path(args.init).exists():
            raise UserError(f"--init {args.init}: no such file or directory; expected an `lm train`/`lm sft` "
                            "workdir, an `lm export` or a Hugging Face model directory")
        init = str(Path(args.init).absolute())  # the run records where its base lives
        keys, elsewhere = {"init": init, "data": args.data, "eval_data": args.eval_data}, []
        for flag, _, *key in self.options:
            dest = flag[2:].replace("-", "_")
            value = getattr(args, dest)
            if value is not None and key:  # a key of another section, set before the user's overrides
                elsewhere.append(f"{key[0]}={str(Path(value).absolute()) if value and Path(value).exists() else value}")
            elif value:
                keys[dest] = value
        config = finetune_config(init_config(init), args.config, [*elsewhere, *overrides], self.section, **keys)
        apply_cpu_defaults(config.model.compute_dtype)  # before anything imports jax
        start_distributed(args)
        summary = self.stage()(config, args.workdir, resume=args.resume, show_progress=not args.no_progress)
        if summary.get("stopped_by"):
            raise Stopped(summary["stopped_by"], summary["step"])
        if summary.get("nothing_to_do"):
            print(f"lm: {args.workdir} already finished at step {summary['step']}; nothing left to do", file=sys.stderr)
            return 0
        if is_main():
            print(f"done: step {summary['step']}; see {args.workdir}/summary.json and {self.plot}")
        return 0


class Reward:
    """`lm reward` trains a reward model; its sub-action `lm reward score` scores with one."""

    def __init__(self, train: FineTune):
        self.train, self.parser, self.required = train, None, []

    def add_parser(self, sub) -> None:
        p, required = self.train.build(sub)
        usage = p.format_usage().removeprefix("usage: ")  # the training form, as argparse writes it
        for action in required:  # argparse cannot require a flag only without a sub-action: run checks them
            action.required = False
        actions = p.add_subparsers(dest="action", prog=p.prog, title="sub-actions")
        score_cli.add_parser(actions)
        p.usage = usage + "       " + actions.choices["score"].format_usage().removeprefix("usage: ")
        self.parser, self.required = p, required

    def run(self, args, overrides) -> int:
        if args.action == "score":
            return score_cli.run(args, overrides)
        missing = [a.option_strings[0] for a in self.required if getattr(args, a.dest) is None]
        if missing:
            self.parser.error(f"the following arguments are required: {', '.join(missing)}")
        return self.train.run(args, overrides)


def _sft():
    from lm.train.sft import sft

    return sft


def _dpo():
    from lm.train.dpo import dpo

    return dpo


def _reward():
    from lm.train.reward import reward

    return reward


def _rl():
    from lm.train.rl import rl

    return rl


def _distill():
    from lm.train.distill import distill

    return distill


EVAL_ANSWERS = ("--eval-answers", "held-out conversations (chat JSONL) answered greedily at the end: "
                                  "exact match of the init and the tuned model")
SFT = FineTune(
    "sft", "fine-tune a trained model on conversations (JSONL), fully or with LoRA",
    "Supervised fine-tuning on the assistant turns of chat or instruction JSONL, starting from a run or an export. "
    "LoRA: --config.model.lora_rank=8.",
    data='JSONL: {"messages": [...]} or {"instruction", "output"} lines',
    eval_data="held-out JSONL: response loss during training, exact match at the end", section="sft", stage=_sft)
DPO = FineTune(
    "dpo", "preference-tune a trained model on pairs (DPO, IPO, SimPO), fully or with LoRA",
    "Direct preference optimisation from a run or an export (usually an `lm sft` run). Loss: "
    "--config.dpo.loss=sigmoid|ipo|simpo, --config.dpo.beta; reference held live or precomputed: "
    "--config.dpo.reference=live|precomputed.",
    data='JSONL pairs: {"prompt": TEXT or MESSAGES, "chosen": TEXT, "rejected": TEXT}',
    eval_data="held-out pairs: DPO metrics (rewards/accuracies, margins, ...) at every eval", section="pairs",
    stage=_dpo, options=(EVAL_ANSWERS,))
REWARD = Reward(FineTune(
    "reward", "train a Bradley-Terry reward model on pairs; `lm reward score` scores texts",
    "A scalar head on a trained model's trunk, trained on preference pairs. "
    "Score with: lm reward score --workdir RUN (--pairs FILE | --texts FILE).",
    data='JSONL pairs: {"prompt", "chosen", "rejected"[, "margin"]}',
    eval_data="held-out pairs: accuracy and mean margin at every eval", section="pairs", stage=_reward))
RL = FineTune(
    "rl", "RL from rewards (GRPO, PPO) on prompts, sampling with the KV cache",
    "Reinforcement learning from a run or an export (usually an `lm sft` run): each step samples "
    "--config.rl.group_size responses per prompt, scores them (--config.rl.rewards=module:function or "
    "file.py:function, --config.rl.reward_model=REWARD_RUN) and updates the policy. --config.rl.algo=grpo|ppo, "
    "--config.rl.beta (KL to the init model).",
    data='JSONL prompts: {"prompt": TEXT or MESSAGES, ...} or {"messages": [...]} lines; '
         "the other keys reach the reward functions",
    eval_data="held-out prompts: mean reward of greedy answers at every eval", section="rl", stage=_rl, plot="rl.png",
    options=(("--rewards", "reward functions, e.g. 'lm.data.synthetic:sort_reward' or "
                           "'my_rewards.py:score=0.5,other.py:fmt' (sets rl.rewards)"),
             ("--reward-model", "an `lm reward` run or export scoring the responses (sets rl.reward_model)"),
             EVAL_ANSWERS))
DISTILL = FineTune(
    "distill", "distil a frozen teacher into a student on conversations (forward/reverse KL, generalized JSD)",
    "Token-level distillation on the assistant turns of chat or instruction JSONL: the student starts from --init, "
    "the teacher (--teacher: any run or export sharing the student's tokenizer, of any size) is frozen beside it. "
    "--config.distill.divergence=forward_kl|reverse_kl|jsd, --config.distill.beta, --config.distill.temperature.",
    data='JSONL: {"messages": [...]} or {"instruction", "output"} lines',
    eval_data="held-out JSONL: divergence, response loss and top-1 agreement during training, exact match at the end",
    section="sft", stage=_distill,
    options=(("--teacher", "the model to learn from: an `lm train`/`lm sft`/`lm rl` workdir or an `lm export` "
                           "(sets distill.teacher)", "distill.teacher"),))
