"""`lm distill`: token-level knowledge distillation from a frozen teacher into a student, on the
responses of chat data, as a stage (lm.train.stage) — SFT's data and report, another loss.

The student starts from `finetune.init` and trains on `finetune.data` (chat or instruction JSONL, the
assistant tokens); the teacher (`distill.teacher`, any run or export sharing the student's
tokenizer, of any width and depth) is a frozen model held beside it on the same mesh, supplied
on every start, never in a checkpoint. The loss is the divergence of `distill.divergence`
(forward KL, reverse KL or GKD's generalized JSD with `distill.beta`) between the two next-token
distributions at `distill.temperature` (lm.train.distill_losses); the student's own response
loss (`nll`) and how often both pick the same top token (`top1_agreement`) are logged beside it.
With `distill.on_policy_fraction` > 0 a share of the steps trains on the student's own sampled
responses instead (GKD's on-policy mix; OnPolicyStep).
"""

from __future__ import annotations

import jax
import numpy as np

from lm.config import rules_table
from lm.data.chat import ChatTemplate
from lm.data.prompts import read_prompts
from lm.errors import UserError
from lm.infer.sampling import SamplingParams
from lm.model.build import build_model
from lm.model.spec import ModelSpec
from lm.store.load import load_init
from lm.train.distill_losses import distill_loss
from lm.train.rollout import Sampler, layout
from lm.train.setup import FrozenSlot
from lm.train.sft import Sft
from lm.train.stage import require_data, run_stage


class Distill(Sft):
    name = "distill"
    eval_metrics = ("loss", "nll", "top1_agreement")
    response_loss = "eval_nll"  # the held-out divergence is eval_loss

    def check(self, config) -> None:
        super().check(config)
        require_data(
            config.distill.teacher, "distill.teacher", "give --teacher RUN_OR_EXPORT (the model to learn from)"
        )

    def read(self, ctx):
        self.teacher = load_init(ctx.config.distill.teacher)
        student, teacher = ctx.init, self.teacher
        if student.tokenizer.fingerprint() != teacher.tokenizer.fingerprint():
            raise UserError(
                f"distill.teacher {teacher.source} and the student {student.source} use different "
                f"tokenizers ({teacher.tokenizer.fingerprint()} != {student.tokenizer.fingerprint()}); "
                "token-level distillation needs the same vocabulary"
            )
        if teacher.config.model.vocab_size != ctx.config.model.vocab_size:
            raise UserError(
                f"distill.teacher {teacher.source} has model.vocab_size={teacher.config.model.vocab_size}"
                f", the student {ctx.config.model.vocab_size}: their logits must cover the same ids"
            )
        if teacher.config.model.max_seq_len < ctx.config.data.seq_len:
            raise UserError(
                f"distill.teacher {teacher.source} has model.max_seq_len={teacher.config.model.max_seq_len}"
                f", shorter than the rows it must score (data.seq_len={ctx.config.data.seq_len})"
            )
        data = super().read(ctx)
        d, s = ctx.config.distill, ctx.config.finetune
        self.prompts = None
        if d.on_policy_fraction > 0:  # the data's prompts, for the student's own responses
            self.prompts = read_prompts(
                s.data,
                student.tokenizer,
                seq_len=ctx.config.data.seq_len,
                max_new_tokens=d.max_new_tokens,
                on_bad_record=s.on_bad_record,
                max_skipped_fraction=s.max_skipped_fraction,
            )
        return data

    def batches(self, ctx):
        data_iter, signature, _ = super().batches(ctx)
        if self.prompts is None:
            return data_iter, signature, None
        template = ChatTemplate.for_tokenizer(ctx.init.tokenizer)
        step = OnPolicyStep(
            ctx.run, ctx.frozen, self.prompts, signature, template, ctx.config.distill, ctx.config.train.seed
        )
        return data_iter, signature, step

    def loss(self, config):
        d = config.distill
        return lambda m: distill_loss(m, d.divergence, d.beta, d.temperature)

    def frozen_slots(self, ctx) -> dict:
        spec, rules = ModelSpec.from_config(self.teacher.config.model).without_lora(), rules_table(ctx.config)
        return {"teacher": lambda mesh: FrozenSlot(build_model(ctx.config, rules=rules, spec=spec, mesh=mesh))}

    def sources(self, ctx) -> dict:
        """The teacher's language model (a PPO run's value head is not part of it)."""
        return {"teacher": {k: v for k, v in self.teacher.params.items() if k != "scalar_head"}}

    def finish(self, ctx) -> dict:
        summary = super().finish(ctx)
        d = ctx.config.distill
        summary |= {
            "teacher": d.teacher,
            "divergence": d.divergence,
            "beta": d.beta,
            "temperature": d.temperature,
            "nll": ctx.last.get("nll"),
            "top1_agreement": ctx.last.get("top1_agreement"),
            "eval_nll": ctx.last.get("eval_nll"),
            "eval_top1_agreement": ctx.last.get("eval_top1_agreement"),
        }
        return summary


def distill(config, workdir, resume: bool = False, show_progress: bool = True) -> dict:
    return run_stage(Distill(), config, workdir, resume, show_progress)


class OnPolicyStep:
    """`step(state, host batch) -> (state, metrics)` of on-policy distillation (GKD): on a share
    `distill.on_policy_fraction` of the steps, drawn per step from the seed, the data's batch is
    set aside and the rows are the student's own responses (sampled with its current params at
    `distill.temperature`) to prompts of the data, drawn per step too; the update is the same
    jitted step either way, so a resumed run repeats exactly what the killed one would have done."""

    def __init__(self, run, frozen, prompts, signature, template, d, seed: int):
        self.run, self.frozen, self.prompts, self.fraction, self.seed = run, frozen, prompts, d.on_policy_fraction, seed
        self.signature, self.placer = signature, run.placer(signature)
        self.update = run.bind(run.train_step(signature), frozen)
        sampling = SamplingParams(max_new_tokens=d.max_new_tokens, temperature=d.temperature)
        self.sampler = Sampler(run, sampling, template.stop_ids, run.config.data.seq_len)

    def __call__(self, state, batch):
        step = int(jax.device_get(state.step))
        draw = np.random.default_rng([self.seed, step])
        if draw.random() >= self.fraction:  # the data's batch: this process's rows of it (lm.train.sft)
            state, metrics = self.update(state, self.placer(batch))
            return state, metrics | {"on_policy": 0.0}
        rows = self.signature["inputs"].shape[0]
        # every process draws the same prompts and samples them all on the shared mesh, then feeds its rows
        index = draw.choice(len(self.prompts), rows, replace=len(self.prompts) < rows)
        prompt_ids = [self.prompts.tokens(int(i)) for i in index]
        params = self.sampler.params(state.params, self.frozen)
        generation = self.sampler(params, prompt_ids, jax.random.fold_in(jax.random.PRNGKey(self.seed), step))
        ro = layout(prompt_ids, generation, self.run.config.data.seq_len)
        state, metrics = self.update(state, self.placer.from_global({k: ro.rows[k] for k in self.signature}))
        return state, metrics | {"on_policy": 1.0, "response_length": float(ro.lengths.mean())}
