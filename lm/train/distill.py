"""`lm distill`: token-level knowledge distillation from a frozen teacher into a student, on the
responses of chat data, as a stage (lm.train.stage) — SFT's data and report, another loss.

The student starts from `sft.init` and trains on `sft.data` (chat or instruction JSONL, the
assistant tokens); the teacher (`distill.teacher`, any run or export sharing the student's
tokenizer, of any width and depth) is a frozen model held beside it on the same mesh, supplied
on every start, never in a checkpoint. The loss is the divergence of `distill.divergence`
(forward KL, reverse KL or GKD's generalized JSD with `distill.beta`) between the two next-token
distributions at `distill.temperature` (lm.train.distill_losses); the student's own response
loss (`nll`) and how often both pick the same top token (`top1_agreement`) are logged beside it.
"""

from __future__ import annotations

import dataclasses

from lm.errors import UserError
from lm.model.build import build_model
from lm.model.layers import ModelSpec
from lm.store.load import load_init
from lm.train.distill_losses import distill_loss
from lm.train.setup import FrozenSlot
from lm.train.sft import Sft
from lm.train.stage import require_data, run_stage


class Distill(Sft):
    verb = "distill"
    eval_metrics = ("loss", "nll", "top1_agreement")
    response_loss = "eval_nll"  # the held-out divergence is eval_loss

    def check(self, config) -> None:
        super().check(config)
        require_data(config.distill.teacher, "distill.teacher", "give --teacher RUN_OR_EXPORT (the model to learn from)")

    def read(self, ctx):
        self.teacher = load_init(ctx.config.distill.teacher)
        student, teacher = ctx.init, self.teacher
        if student.tokenizer.fingerprint() != teacher.tokenizer.fingerprint():
            raise UserError(f"distill.teacher {teacher.source} and the student {student.source} use different "
                            f"tokenizers ({teacher.tokenizer.fingerprint()} != {student.tokenizer.fingerprint()}); "
                            "token-level distillation needs the same vocabulary")
        if teacher.config.model.vocab_size != ctx.config.model.vocab_size:
            raise UserError(f"distill.teacher {teacher.source} has model.vocab_size={teacher.config.model.vocab_size}"
                            f", the student {ctx.config.model.vocab_size}: their logits must cover the same ids")
        if teacher.config.model.max_seq_len < ctx.config.data.seq_len:
            raise UserError(f"distill.teacher {teacher.source} has model.max_seq_len={teacher.config.model.max_seq_len}"
                            f", shorter than the rows it must score (data.seq_len={ctx.config.data.seq_len})")
        return super().read(ctx)

    def loss(self, config):
        d = config.distill
        return lambda m: distill_loss(m, d.divergence, d.beta, d.temperature)

    def frozen_slots(self, ctx) -> dict:
        spec = dataclasses.replace(ModelSpec.from_config(self.teacher.config.model), lora_rank=0)
        return {"teacher": lambda mesh: FrozenSlot(build_model(ctx.config, spec=spec, mesh=mesh))}

    def sources(self, ctx) -> dict:
        return {"teacher": self.teacher.params}

    def finish(self, ctx) -> dict:
        summary = super().finish(ctx)
        d = ctx.config.distill
        summary |= {"teacher": d.teacher, "divergence": d.divergence, "beta": d.beta, "temperature": d.temperature,
                    "nll": ctx.last.get("nll"), "top1_agreement": ctx.last.get("top1_agreement"),
                    "eval_nll": ctx.last.get("eval_nll"), "eval_top1_agreement": ctx.last.get("eval_top1_agreement")}
        return summary


def distill(config, workdir, resume: bool = False, show_progress: bool = True) -> dict:
    return run_stage(Distill(), config, workdir, resume, show_progress)
