"""`lm rl`: reinforcement learning from rewards (GRPO or PPO) from a trained model on prompts.

Each step samples responses with the KV-cache sampler, scores them and updates the policy
(lm.train.rl_step); the one loop (lm.train.fit) runs the steps, with held-out greedy rewards
at every eval, checkpoints (the prompt stream's position included: a killed run resumes
exactly), signals and metrics. The reference for the KL is the init model, frozen: a copy in
the compute dtype beside the policy (with LoRA: the base with the adapters off); beta = 0
holds none. PPO puts a value head (lm.model.heads.ScalarHead, zero at the start) on the
policy's trunk. At the end: reward and KL curves (rl.png), and with `finetune.eval_answers` the
exact match of the init and the tuned model's greedy answers.
"""

from __future__ import annotations

import jax

from lm.config import with_values
from lm.data.chat import ChatTemplate
from lm.data.pipeline import Source, train_dataset
from lm.data.prompts import PromptSet, describe, read_prompts
from lm.errors import UserError
from lm.eval.answers import compare_answers
from lm.infer.sampling import SamplingParams
from lm.model import counts
from lm.model.build import reward_model
from lm.model.lora import is_adapter, is_adapter_or_head
from lm.model.transformer import Transformer
from lm.sharding import SIMULATE_HINT, make_mesh
from lm.train import rl_step
from lm.train.environments import environment_factory
from lm.train.episodes import EpisodeRollouts, Limits
from lm.train.metrics import plot_rl
from lm.train.rewards import Rewards
from lm.train.rl_losses import RlSettings, rl_loss
from lm.train.rollout import Sampler, Scorer
from lm.train.setup import build_run, reference_slot
from lm.train.stage import Stage, first_eval, require_data, run_stage, trainable_count

SUMMARY_KEYS = (
    "reward",
    "kl",
    "loss",
    "response_length",
    "rollout_tokens_per_s",
    "update_tokens_per_s",
    "sampling_share",
    "eval_reward",
    "reward_failed_share",
    "compile_s",
)


def rl_config(config):
    """The config of an RL run: train.batch_size is the rows of one update minibatch (a new config)."""
    return with_values(config, {"train.batch_size": update_rows(config)})


def update_rows(config) -> int:
    """Rows of one update minibatch: the step's responses over rl.minibatches."""
    r = config.rl
    return r.prompts_per_step * r.group_size // r.minibatches


def needs_reference(config) -> bool:
    """Whether the KL term needs the reference's log-probs (rl.beta > 0)."""
    return RlSettings.from_config(config.rl).needs_reference


def compiled_step(config, devices, spec):
    """The step `lm plan` compiles (lm.train.registry): one GRPO/PPO update minibatch, with the
    reference when the KL needs one (the run's own spec: `spec` is not used)."""
    run = build_rl_run(rl_config(config), devices)
    fields = rl_step.extra_fields(RlSettings.from_config(run.config.rl))
    t = run.config.data.seq_len
    return run, run.signature(extra={k: ((t,), dt) for k, dt in fields.items()})


def split_devices(config, devices=None) -> tuple[list, object]:
    """(the devices that train, the generation mesh or None): with rl.generation_devices = g
    the last g devices generate, on a mesh of data x rl.generation_tensor."""
    devices = list(jax.devices() if devices is None else devices)
    g, r = config.rl.generation_devices, config.rl
    if not g:
        return devices, None
    if jax.process_count() > 1:
        raise UserError(
            f"rl.generation_devices={g}: generation on devices of its own runs in one process "
            f"(this run has {jax.process_count()}); set rl.generation_devices=0"
        )
    if g >= len(devices):
        raise UserError(
            f"rl.generation_devices={g} leaves none of the {len(devices)} devices to train on; "
            f"expected fewer than {len(devices)}. {SIMULATE_HINT}"
        )
    return devices[:-g], make_mesh({"data": -1, "tensor": r.generation_tensor}, devices[-g:])


def build_rl_run(config, devices=None):
    """The run of `lm rl`: the policy (with a value head for PPO), its loss and the reference,
    on the devices that train (`split_devices`)."""
    config = rl_config(config)
    devices, _ = split_devices(config, devices)
    r, settings = config.rl, RlSettings.from_config(config.rl)
    lora = config.model.lora_rank > 0
    model_fn = reward_model if r.algo == "ppo" else Transformer  # PPO's value head is a scalar head
    trainable = (is_adapter_or_head if r.algo == "ppo" else is_adapter) if lora else None
    frozen = {"reference": reference_slot(config, lora)} if settings.needs_reference else None
    return build_run(
        config,
        lambda m: rl_loss(m, settings),
        devices=devices,
        model_fn=model_fn,
        trainable=trainable,
        frozen=frozen,
        updates_per_step=r.epochs * r.minibatches,
    )


def _prompts(path, loaded, config, limit: int = 0) -> PromptSet:
    f = config.finetune
    return read_prompts(
        path,
        loaded.tokenizer,
        seq_len=config.data.seq_len,
        max_new_tokens=config.rl.max_new_tokens,
        on_bad_record=f.on_bad_record,
        max_skipped_fraction=f.max_skipped_fraction,
        limit=limit,
    )


class Rl(Stage):
    """Prompts in; each step samples, scores and updates (lm.train.rl_step)."""

    name = "rl"
    init_section = "finetune"
    check_eval_batch = False  # held-out prompts are answered in batches of their own

    def check(self, config) -> None:
        require_data(config.finetune.data, "finetune.data", 'give `lm rl --data prompts.jsonl` ({"prompt": ...} lines)')

    def read(self, ctx):
        r, f = ctx.config.rl, ctx.config.finetune
        prompts = _prompts(f.data, ctx.init, ctx.config)
        print(f"rl prompts {f.data}: {describe(prompts.stats)}")
        heldout = _prompts(f.eval_data, ctx.init, ctx.config, limit=r.eval_prompts) if f.eval_data else None
        if r.environment:  # its steps give the rewards; made now so a bad name fails before the model loads
            return prompts, heldout, environment_factory(r.environment)
        return prompts, heldout, Rewards.from_config(r)

    def configure(self, ctx):
        return rl_config(ctx.config)

    def build(self, ctx):
        return build_rl_run(ctx.config)

    def stats(self, ctx) -> dict:
        return {"prompts": ctx.data[0].stats}

    def make_sampler(self, ctx) -> tuple[ChatTemplate, Sampler]:
        """The init model's chat template and the policy's sampler (rl.* sampling settings)."""
        c, r = ctx.config, ctx.config.rl
        template = ChatTemplate.for_tokenizer(ctx.init.tokenizer)
        sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p)
        _, generation_mesh = split_devices(c)
        return template, Sampler(ctx.run, sampling, template.stop_ids, c.data.seq_len, r.speculate, generation_mesh)

    def prompt_stream(self, ctx, prompts):
        """Batches of rl.prompts_per_step prompt indices. Every process reads the whole batch (the
        same seed draws the same one): each samples all rollouts on the shared mesh and feeds the
        update rows its devices hold (lm.train.rl_step)."""
        c = ctx.config
        return iter(
            train_dataset(
                [Source(c.finetune.data, prompts, 1.0)],
                seq_len=c.data.seq_len,
                global_batch=c.rl.prompts_per_step,
                seed=c.train.seed,
                pack=False,
            )
        )

    def batches(self, ctx):
        c, r, run = ctx.config, ctx.config.rl, ctx.run
        prompts, _, rewards = ctx.data
        settings = RlSettings.from_config(r)
        template, sampler = self.make_sampler(ctx)
        self.scorer = Scorer(run, settings.algo == "ppo", with_policy=r.max_staleness > 0)
        episodes = None
        if r.environment:
            limits = Limits(r.max_turns, r.max_episode_tokens, r.tool_seconds)
            episodes = EpisodeRollouts(sampler, template, rewards, limits, c.data.seq_len, r.truncation_penalty)
            rewards = None
        else:
            rewards.place(run.mesh)
        args = (run, ctx.frozen, prompts, rewards, sampler, self.scorer, template, settings, r)
        self.step = rl_step.RlStep(*args, episodes=episodes)
        # with rl.max_staleness > 0 rollouts are sampled ahead while the updates run (lm.train.rl_async)
        return self.step.stream(self.prompt_stream(ctx, prompts)), self.step.signature, self.step

    def evaluator(self, ctx):
        heldout = ctx.data[1]
        if heldout is None:
            return None
        return rl_step.evaluator(self.step, heldout, ctx.config.rl.eval_prompts, ctx.config.eval.batch_size)

    def flops_per_token(self, ctx):
        # MFU counts, per token of a rollout row: the updates (epochs x 6N), the scoring pass (2N)
        # and sampling (~2N); the loop's tokens per step are those of one minibatch
        r = ctx.config.rl
        passes = r.epochs + (self.scorer.active + 1) / 3
        return counts.flops_per_token(ctx.config.model, ctx.config.data.seq_len) * passes * r.minibatches

    def first_row(self, ctx) -> dict:
        return {"trainable_params": trainable_count(ctx.run), **{f"data/{k}": v for k, v in ctx.data[0].stats.items()}}

    def finish(self, ctx) -> dict:
        c, r, f = ctx.config, ctx.config.rl, ctx.config.finetune
        policy = {k: v for k, v in ctx.params.items() if k != "scalar_head"}
        summary = {
            "step": c.train.steps,
            "init": f.init,
            "algo": r.algo,
            "lora_rank": c.model.lora_rank,
            "eval_init": first_eval(ctx.workdir),
            "eval": {k: v for k, v in ctx.last.items() if k.startswith("eval_")},
        }
        summary |= {k: ctx.last.get(k) for k in SUMMARY_KEYS}
        if summary["eval"]:
            print(
                f"held-out greedy reward: init {summary['eval_init'].get('eval_reward', float('nan')):.4f} -> "
                f"tuned {summary['eval'].get('eval_reward', float('nan')):.4f}"
            )
        if f.eval_answers:
            summary |= compare_answers(ctx.init, c, policy, f.eval_answers, f.eval_examples, f.eval_max_new_tokens)
        return summary

    def plot(self, ctx) -> None:
        plot_rl(ctx.workdir / "metrics.jsonl", ctx.workdir / "rl.png")


def rl(config, workdir, resume: bool = False, show_progress: bool = True) -> dict:
    return run_stage(Rl(), config, workdir, resume, show_progress)
