"""The one table of stages: what the CLI, the planner and ahead-of-time compilation know of each.

A stage is declared once, as a `StageEntry`: its verb and help, the flags it adds, its config
section, its stage function, and the compiled steps `lm plan` sizes and `lm.plan.aot` compiles
(`CompiledStep`: a builder and the facts the planner needs). Code is named by reference
("module:function") and imported only when used: reading the table imports no jax (the CLI sets
the CPU flags before anything imports it). Nothing that reads the table branches on a stage's
name; a new stage is one entry here (or `register` from its own module) beside its stage file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib

# what the loss sees of each row of a step: one sequence, or the two of a preference pair
PAIR_ROWS = 2


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """A jitted step that `lm plan --steps NAME` sizes and compiles.

    build: "module:function". A training step's builder is `(config, devices, spec) -> (run,
      signature)`: the stage's own lm.train.setup.Run and batch signature; a generation step's is
      `(config, devices) -> lm.plan.aot_steps.StepBuild`.
    kind: "train" (an update: params, optimizer state, gradients) or "generation" (a decode step
      against a KV cache, eval.batch_size rows).
    passes: model FLOPs per token in units of one forward pass (2N): a full update 3 (forward,
      backward for activations and for weights), LoRA about 2, a live reference one more.
    lora: only LoRA adapters train (model.lora_rank, or the planner's default) and the base is
      frozen in the compute dtype; otherwise the step is built with model.lora_rank=0.
    rows_per_example: sequences per row of train.batch_size (PAIR_ROWS: chosen and rejected).
    rows: "module:function" (config) -> rows of one update, when not train.batch_size.
    reference: a frozen copy of the init model in the compute dtype: "none", "argument" (the step
      reads it) or "resident" (held beside the step, e.g. for a scoring pass; not its argument).
    needs_reference: "module:function" (config) -> bool, whether the config keeps that reference.
    splits_batch: the fit search keeps only settings whose train.batch_size splits evenly over
      the batch axes (a step whose rows are not train.batch_size checks its own when sized).
    """

    name: str
    build: str
    kind: str = "train"
    passes: float = 3
    lora: bool = False
    rows_per_example: int = 1
    rows: str | None = None
    reference: str = "none"
    needs_reference: str | None = None
    splits_batch: bool = True

    @property
    def generation(self) -> bool:
        return self.kind == "generation"

    def update_rows(self, config) -> int:
        """Examples of one update (before rows_per_example): train.batch_size unless `rows` says."""
        return load(self.rows)(config) if self.rows else config.train.batch_size

    def holds_reference(self, config) -> bool:
        return self.reference != "none" and (self.needs_reference is None or load(self.needs_reference)(config))


@dataclasses.dataclass(frozen=True)
class StageEntry:
    """A training stage as the CLI and the planner see it.

    name: the stage's name. verb: its command, `lm VERB` (default: the name).
    start: "config" (a config file; --init optional: pretraining) or "init" (a trained model,
      --init and JSONL --data required: fine-tuning).
    help, description: the verb's line in `lm --help` and its own help's description.
    data, eval_data: help of --data and --eval-data (start="init"), which set finetune.data and
      finetune.eval_data (--init: finetune.init).
    section: the config section of its own settings.
    defaults: (dotted key, value) pairs where the stage's default differs from the schema's
      (start="init": applied over the fine-tuning defaults, before the config file).
    stage: "module:function", `(config, workdir, resume, show_progress) -> summary`.
    options: more flags, each (flag, help[, dotted key]): the key named by the flag in the
      finetune section if it has one, else in its section; or the dotted key given.
    actions: modules (`add_parser`, `run`) that add sub-actions to the verb (`lm reward score`).
    reads: the finetune keys it reads (start="init"; empty: all); setting another one away from
      its default is an error, since the stage would ignore it.
    plot: the plot its summary line names.
    steps: the compiled steps `lm plan` and `lm.plan.aot` know it by.
    """

    name: str
    help: str
    stage: str
    section: str
    verb: str = ""
    start: str = "init"
    description: str | None = None
    data: str = ""
    eval_data: str = ""
    options: tuple[tuple[str, ...], ...] = ()
    defaults: tuple[tuple[str, object], ...] = ()
    actions: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()
    plot: str = "loss.png"
    steps: tuple[CompiledStep, ...] = ()

    @property
    def command(self) -> str:
        return self.verb or self.name


def stage_entry(name: str) -> StageEntry:
    """The registered stage called `name`."""
    for entry in _STAGES:
        if entry.name == name:
            return entry
    raise ValueError(f"unknown stage {name!r}; registered: {', '.join(e.name for e in _STAGES)}")


def load(reference: str):
    """The object a "module:name" reference names (imported now)."""
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


EVAL_ANSWERS = (
    "--eval-answers",
    "held-out conversations (chat JSONL) answered greedily at the end: exact match of the init and the tuned model",
)
# the finetune keys (lm.config.finetune) each kind of stage reads
_START = ("init", "data", "eval_data", "on_bad_record", "max_skipped_fraction")
_ANSWERS = ("eval_examples", "eval_max_new_tokens")
READS_CHAT = (*_START, "epochs", "truncation", "train_on", *_ANSWERS)
READS_PAIRS = (*_START, "epochs", "truncation")
READS_PROMPTS = (*_START, "eval_answers", *_ANSWERS)
CHAT_DATA = 'JSONL: {"messages": [...]} or {"instruction", "output"} lines'

_STAGES: list[StageEntry] = [
    StageEntry(
        "pretrain",
        "pretrain a model (default: tiny model on the Python standard library)",
        "lm.train.pretrain:train",
        "train",
        verb="train",
        start="config",
        steps=(CompiledStep("pretrain", "lm.train.pretrain:compiled_step"),),
    ),
    StageEntry(
        "sft",
        "fine-tune a trained model on conversations (JSONL), fully or with LoRA",
        "lm.train.sft:sft",
        "finetune",
        description="Supervised fine-tuning on the assistant turns of chat or instruction JSONL, starting from a "
        "run or an export. LoRA: --config.model.lora_rank=8.",
        data=CHAT_DATA,
        eval_data="held-out JSONL: response loss during training, exact match at the end",
        defaults=(("finetune.epochs", 3.0),),
        steps=(
            CompiledStep("sft", "lm.train.sft:compiled_step"),
            CompiledStep("sft_lora", "lm.train.sft:compiled_step", passes=2, lora=True),
        ),
        reads=READS_CHAT,
    ),
    StageEntry(
        "dpo",
        "preference-tune a trained model on pairs (DPO, IPO, SimPO, ORPO), fully or with LoRA",
        "lm.train.dpo:dpo",
        "dpo",
        description="Direct preference optimisation from a run or an export (usually an `lm sft` run). Loss: "
        "--config.dpo.loss=sigmoid|ipo|simpo|orpo, --config.dpo.beta; reference held live or precomputed: "
        "--config.dpo.reference=live|precomputed.",
        data='JSONL pairs: {"prompt": TEXT or MESSAGES, "chosen": TEXT, "rejected": TEXT}',
        eval_data="held-out pairs: DPO metrics (rewards/accuracies, margins, ...) at every eval",
        options=(EVAL_ANSWERS,),
        steps=(
            CompiledStep(
                "dpo",
                "lm.train.dpo:compiled_step",
                passes=4,
                rows_per_example=PAIR_ROWS,
                reference="argument",
                needs_reference="lm.train.dpo:needs_reference",
            ),
        ),
        reads=(*READS_PAIRS, "eval_answers", *_ANSWERS),
    ),
    StageEntry(
        "kto",
        "preference-tune a trained model on unpaired good/bad examples (KTO), fully or with LoRA",
        "lm.train.kto:kto",
        "kto",
        description="Kahneman-Tversky optimisation from a run or an export (usually an `lm sft` run) on "
        "completions labelled desirable or not: --config.kto.beta, --config.kto.desirable_weight, "
        "--config.kto.undesirable_weight; reference held live or precomputed: --config.kto.reference=live|precomputed.",
        data='JSONL examples: {"prompt": TEXT or MESSAGES, "completion": TEXT, "label": true|false}',
        eval_data="held-out examples: KTO metrics (kl, rewards/chosen, rewards/rejected) at every eval",
        options=(EVAL_ANSWERS,),
        steps=(
            CompiledStep(
                "kto",
                "lm.train.kto:compiled_step",
                passes=4,
                rows_per_example=PAIR_ROWS,
                reference="argument",
            ),
        ),
        reads=(*READS_PAIRS, "eval_answers", *_ANSWERS),
    ),
    StageEntry(
        "reward",
        "train a Bradley-Terry reward model on pairs; `lm reward score` scores texts",
        "lm.train.reward:reward",
        "reward",
        description="A scalar head on a trained model's trunk, trained on preference pairs. "
        "Score with: lm reward score --workdir RUN (--pairs FILE | --texts FILE).",
        data='JSONL pairs: {"prompt", "chosen", "rejected"[, "margin"]}',
        eval_data="held-out pairs: accuracy and mean margin at every eval",
        actions=("lm.infer.score_cli",),
        reads=READS_PAIRS,
    ),
    StageEntry(
        "rl",
        "RL from rewards (GRPO, PPO) on prompts, sampling with the KV cache",
        "lm.train.rl:rl",
        "rl",
        description="Reinforcement learning from a run or an export (usually an `lm sft` run): each step samples "
        "--config.rl.group_size responses per prompt, scores them (--config.rl.rewards=module:function "
        "or file.py:function, --config.rl.reward_model=REWARD_RUN) and updates the policy. "
        "--config.rl.algo=grpo|ppo, --config.rl.beta (KL to the init model).",
        data='JSONL prompts: {"prompt": TEXT or MESSAGES, ...} or {"messages": [...]} lines; '
        "the other keys reach the reward functions",
        eval_data="held-out prompts: mean reward of greedy answers at every eval",
        plot="rl.png",
        defaults=(("finetune.max_skipped_fraction", 0.01),),
        options=(
            (
                "--rewards",
                "reward functions, e.g. 'lm.data.synthetic:sort_reward' or "
                "'my_rewards.py:score=0.5,other.py:fmt' (sets rl.rewards)",
            ),
            ("--reward-model", "an `lm reward` run or export scoring the responses (sets rl.reward_model)"),
            EVAL_ANSWERS,
        ),
        steps=(
            CompiledStep(
                "rl",
                "lm.train.rl:compiled_step",
                rows="lm.train.rl:update_rows",
                reference="resident",
                needs_reference="lm.train.rl:needs_reference",
                splits_batch=False,
            ),
        ),
        reads=READS_PROMPTS,
    ),
    StageEntry(
        "online_dpo",
        "online DPO: pairs sampled from the policy each step, ranked by rewards, one DPO update",
        "lm.train.online_dpo:online_dpo",
        "dpo",
        verb="online-dpo",
        description="Online DPO from a run or an export (usually an `lm sft` run): each step samples "
        "--config.rl.group_size responses (2) to --config.rl.prompts_per_step prompts, ranks them with lm rl's "
        "rewards (--rewards, --reward-model, --config.rl.reward_url) and takes a DPO update on each prompt's best "
        "vs worst (--config.dpo.loss, --config.dpo.beta; the reference held live).",
        data='JSONL prompts: {"prompt": TEXT or MESSAGES, ...} or {"messages": [...]} lines; '
        "the other keys reach the reward functions",
        eval_data="held-out prompts: mean reward of greedy answers at every eval",
        plot="rl.png",
        defaults=(("rl.group_size", 2), ("finetune.max_skipped_fraction", 0.01)),
        options=(
            ("--rewards", "reward functions or verifiers (sets rl.rewards)", "rl.rewards"),
            (
                "--reward-model",
                "an `lm reward` run or export ranking the responses (sets rl.reward_model)",
                "rl.reward_model",
            ),
            EVAL_ANSWERS,
        ),
        reads=READS_PROMPTS,
    ),
    StageEntry(
        "rft",
        "rejection-sampling fine-tuning: best of n sampled responses per prompt, kept above a reward threshold",
        "lm.train.rft:rft",
        "rft",
        description="Best-of-n from a run or an export (usually an `lm sft` run): --config.rft.samples responses per "
        "prompt, scored by lm rl's rewards (--rewards, --reward-model, --config.rl.reward_url); each prompt's best "
        "above --config.rft.threshold is kept and fine-tuned on as `lm sft` does. Report: rft_report.json.",
        data='JSONL prompts: {"prompt": TEXT or MESSAGES, ...} or {"messages": [...]} lines; '
        "the other keys reach the reward functions",
        eval_data="held-out conversations: response loss during training, exact match at the end",
        options=(
            ("--rewards", "reward functions or verifiers (sets rl.rewards)", "rl.rewards"),
            (
                "--reward-model",
                "an `lm reward` run or export scoring the responses (sets rl.reward_model)",
                "rl.reward_model",
            ),
        ),
        defaults=(("finetune.epochs", 3.0),),
        reads=READS_CHAT,
    ),
    StageEntry(
        "distill",
        "distil a frozen teacher into a student on conversations (forward/reverse KL, generalized JSD)",
        "lm.train.distill:distill",
        "distill",
        description="Token-level distillation on the assistant turns of chat or instruction JSONL: the student "
        "starts from --init, the teacher (--teacher: any run or export sharing the student's tokenizer, "
        "of any size) is frozen beside it. --config.distill.divergence=forward_kl|reverse_kl|jsd, "
        "--config.distill.beta, --config.distill.temperature.",
        data=CHAT_DATA,
        defaults=(("finetune.epochs", 3.0),),
        eval_data="held-out JSONL: divergence, response loss and top-1 agreement during training, exact match at "
        "the end",
        options=(
            (
                "--teacher",
                "the model to learn from: an `lm train`/`lm sft`/`lm rl` workdir or an `lm export` "
                "(sets distill.teacher)",
                "distill.teacher",
            ),
        ),
        reads=READS_CHAT,
    ),
]

# Not a stage: the generation engine's decode block, which sampling, serving, evaluation and RL
# rollouts share; `lm plan` sizes and compiles it beside the stages' steps.
GENERATION: tuple[CompiledStep, ...] = (
    CompiledStep("decode", "lm.plan.aot_steps:_decode", kind="generation", passes=1),
)


def stages() -> tuple[StageEntry, ...]:
    """Every stage, in `lm --help` order."""
    return tuple(_STAGES)


def compiled_steps() -> tuple[CompiledStep, ...]:
    """Every compiled step: the stages' in their order, then generation's."""
    return tuple(s for entry in _STAGES for s in entry.steps) + GENERATION


def step_names() -> tuple[str, ...]:
    return tuple(s.name for s in compiled_steps())


def compiled_step(name: str) -> CompiledStep:
    for step in compiled_steps():
        if step.name == name:
            return step
    raise ValueError(f"unknown step {name!r}")


def register(entry: StageEntry) -> StageEntry:
    """Adds a stage (after the others); its name, verb and steps must be new."""
    taken = {e.name for e in _STAGES} | {e.command for e in _STAGES} | set(step_names())
    clash = sorted(taken & ({entry.name, entry.command} | {s.name for s in entry.steps}))
    if clash:
        raise ValueError(f"stage {entry.name!r}: {', '.join(clash)} already registered")
    _STAGES.append(entry)
    return entry


def unregister(name: str) -> None:
    _STAGES[:] = [e for e in _STAGES if e.name != name]


@contextlib.contextmanager
def registered(entry: StageEntry):
    """`entry` registered for the duration of the block."""
    register(entry)
    try:
        yield entry
    finally:
        unregister(entry.name)
