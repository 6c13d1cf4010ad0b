"""What the fault drill (bench/fault_drill.py) runs: the inputs every stage starts from (a corpus,
the sort task and its pairs, a reward file, a small base model and a teacher), each stage's
command on tiny shapes, so that a step takes milliseconds and a run's cost is its start-up, and
the plan of episodes (kills, stops, damage) its drilled run goes through."""

from __future__ import annotations

import dataclasses
import pathlib
import random
import shutil
import sysconfig

from fault_drill_parts import CACHE_DAMAGE, CHECKPOINT_DAMAGE, Child, child_env

STAGES = ("pretrain", "sft", "sft-lora", "dpo", "dpo-precomputed", "reward", "grpo", "ppo", "distill")
UNCACHED = ("grpo", "ppo")  # RL reads its prompts directly: no prepared-data cache entry to damage
STEPS, EVERY = 30, 3  # each stage's run; a checkpoint every EVERY steps, the newest 3 kept

TINY = [
    "--config.data.curate=false",
    "--config.data.tokenizer=byte",
    "--config.model.vocab_size=264",
    "--config.model.d_model=32",
    "--config.model.n_layers=2",
    "--config.model.n_heads=2",
    "--config.model.n_kv_heads=1",
    "--config.model.d_ff=64",
    "--config.train.sample_tokens=8",
]
COMMON = [
    "--config.train.batch_size=8",
    "--config.eval.batch_size=8",
    "--config.eval.batches=1",
    "--config.train.peak_flops=1e11",
    "--config.train.log_every=1",
    "--config.eval.every_steps=6",
    f"--config.train.steps={STEPS}",
    f"--config.checkpoint.every_steps={EVERY}",
    "--config.checkpoint.keep=3",
    "--no-progress",
]
SFT = ["--config.finetune.epochs=0", "--config.finetune.eval_examples=4", "--config.finetune.eval_max_new_tokens=6"]
PAIRS = ["--config.finetune.epochs=0", "--config.pairs.eval_pairs=8", "--config.optim.lr=1e-3"]
RL = [
    "--config.rl.prompts_per_step=2",
    "--config.rl.group_size=4",
    "--config.rl.max_new_tokens=6",
    "--config.rl.eval_prompts=4",
    "--config.optim.lr=1e-3",
    "--config.eval.batch_size=4",
]
# A reward with spread on an untrained model (the sort task's exact answer is never found: no gradient).
OVERLAP = """
def overlap(prompts, completions, answer, **columns):
    return [sum(ch in a for ch in c) / max(len(c), 1) for c, a in zip(completions, answer)]
"""
MODELS = {"base": [], "teacher": ["--config.model.d_model=48", "--config.model.n_layers=3", "--config.model.d_ff=96"]}


@dataclasses.dataclass
class Inputs:
    corpus: pathlib.Path
    task: dict
    pairs: dict
    rewards: str
    base: pathlib.Path | None = None
    teacher: pathlib.Path | None = None


def setup(tmp: pathlib.Path, stages: list[str], timeout: float) -> Inputs:
    """Writes the inputs under `tmp`; pretrains the base (and the teacher) only if a stage needs them."""
    from lm.data.synthetic import write_sort_pairs, write_sort_task

    corpus = tmp / "corpus"
    corpus.mkdir()
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    for name in [
        "abc.py",
        "bisect.py",
        "colorsys.py",
        "copy.py",
        "fnmatch.py",
        "heapq.py",
        "keyword.py",
        "numbers.py",
        "operator.py",
        "queue.py",
        "shlex.py",
        "textwrap.py",
    ]:
        shutil.copy(stdlib / name, corpus / name)
    (tmp / "rewards.py").write_text(OVERLAP)
    inp = Inputs(
        corpus,
        write_sort_task(tmp / "task", n_train=200, n_heldout=8),
        write_sort_pairs(tmp / "task", n_train=64, n_heldout=8),
        f"{tmp / 'rewards.py'}:overlap",
    )
    wanted = ["base"] * any(s != "pretrain" for s in stages) + ["teacher"] * ("distill" in stages)
    for name in wanted:
        argv = [
            "train",
            "--workdir",
            str(tmp / name),
            f"--config.data.corpus={corpus}",
            *TINY,
            *MODELS[name],
            "--config.train.steps=10",
            "--config.eval.every_steps=10",
            "--config.data.seq_len=64",
            "--config.train.batch_size=8",
            "--config.eval.batch_size=8",
            "--config.eval.batches=1",
            "--config.train.peak_flops=1e11",
            "--no-progress",
        ]
        child = Child(argv, tmp / f"{name}.log", child_env(tmp / "cache-setup"), timeout)
        if child.finish() != 0:
            raise SystemExit(f"setup: the {name} model's run failed (exit {child.proc.returncode}); see {child.log}")
        setattr(inp, name, tmp / name)
    return inp


def stage_command(name: str, inp: Inputs) -> list[str]:
    """The stage's `lm` arguments without --workdir and --resume."""
    tune = ["--init", str(inp.base)]
    if name == "pretrain":
        return [
            "train",
            f"--config.data.corpus={inp.corpus}",
            *TINY,
            "--config.data.seq_len=32",
            "--config.optim.warmup_steps=10",
            *COMMON,
        ]
    if name in ("sft", "sft-lora", "distill"):
        verb = ["distill", "--teacher", str(inp.teacher)] if name == "distill" else ["sft"]
        lora = ["--config.model.lora_rank=4"] if name == "sft-lora" else []
        return [
            *verb,
            *tune,
            "--data",
            str(inp.task["train"]),
            "--eval-data",
            str(inp.task["heldout"]),
            *SFT,
            *COMMON,
            *lora,
        ]
    if name in ("dpo", "dpo-precomputed", "reward"):
        precomputed = ["--config.dpo.reference=precomputed"] if name == "dpo-precomputed" else []
        return [
            "reward" if name == "reward" else "dpo",
            *tune,
            "--data",
            str(inp.pairs["train"]),
            "--eval-data",
            str(inp.pairs["heldout"]),
            *PAIRS,
            *COMMON,
            *precomputed,
        ]
    if name in ("grpo", "ppo"):
        return [
            "rl",
            *tune,
            "--data",
            str(inp.task["train"]),
            "--eval-data",
            str(inp.task["heldout"]),
            "--rewards",
            inp.rewards,
            *COMMON,
            *RL,
            f"--config.rl.algo={name}",
        ]
    raise ValueError(name)


@dataclasses.dataclass
class Episode:
    end: str  # how the child ends: sigkill_step|sigkill_save|sigkill_time|sigterm_start|sigterm_mid|sigterm_end|finish
    target: int = 0  # the step a kill or a mid-run stop waits for
    damage: list = dataclasses.field(default_factory=list)
    writer: bool = False  # a second writer tries the workdir while this child holds it
    before: tuple | None = None  # final_metrics.json's stamp when the child started


def plan(rng: random.Random, kills: int, cached: bool) -> list[Episode]:
    """A fresh start stopped at once, a fresh run SIGKILLed (a second writer tried meanwhile), the
    other kills and a mid-run SIGTERM in random order, a resume stopped at start-up, one stopped
    after its last checkpoint, and the resume that finishes; one damage before each resume that
    restores, in turn."""
    targets = sorted(rng.sample(range(2 * EVERY + 1, STEPS - EVERY), kills + 1))
    kinds = [["sigkill_save", "sigkill_time", "sigkill_step"][i % 3] for i in range(kills - 1)]
    rng.shuffle(kinds)
    kinds.insert(rng.randrange(kills), "sigterm_mid")
    episodes = [Episode("sigterm_start"), Episode("sigkill_step", targets[0], writer=True)]
    episodes += [Episode(kind, t) for kind, t in zip(kinds, targets[1:])]
    episodes += [Episode("sigterm_start"), Episode("sigterm_end"), Episode("finish")]
    restoring = [e for e in episodes[2:] if e.end != "sigterm_start"]
    damages = [*CHECKPOINT_DAMAGE, *(CACHE_DAMAGE if cached else ())]
    for i, kind in enumerate(damages):
        restoring[i % len(restoring)].damage.append(kind)
    return episodes
