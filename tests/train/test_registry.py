"""A stage declared in one file (this one: `toy`, pretraining with a label-smoothed loss) is picked up
by the CLI (`lm toy`), the planner (`lm plan --steps toy`) and ahead-of-time compilation, through
the stage registry alone."""

import json

import jax
import jax.numpy as jnp
import pytest

from lm import cli
from lm.model.apply import add_aux, forward
from lm.train.pretrain import Pretrain
from lm.train.registry import CompiledStep, StageEntry, register, registered, step_names
from lm.train.setup import build_run
from lm.train.stage import run_stage
from tests.e2e.test_cli_train import SMALL

SMOOTHING = 0.1


def toy_loss(model):
    """Next-token cross-entropy against targets smoothed towards the uniform distribution."""

    def loss_fn(params, batch, frozen, rng):
        logits, aux = forward(model, params, batch, rng)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        target = jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
        mask = batch["loss_mask"].astype(jnp.float32)
        nll = -jnp.sum(((1 - SMOOTHING) * target + SMOOTHING * logp.mean(-1)) * mask)
        return add_aux(model, nll, {"loss_sum": nll, "count": jnp.sum(mask)}, aux)

    return loss_fn


class Toy(Pretrain):
    name = "toy"

    def build(self, ctx):
        return build_run(ctx.config, toy_loss)


def toy(config, workdir, resume: bool = False, show_progress: bool = True) -> dict:
    return run_stage(Toy(), config, workdir, resume, show_progress)


def compiled_step(config, devices, spec):
    run = build_run(config, toy_loss, devices=devices, spec=spec)
    return run, run.signature()


TOY = StageEntry(
    "toy",
    "pretrain with a label-smoothed loss",
    f"{__name__}:toy",
    "train",
    start="config",
    steps=(CompiledStep("toy", f"{__name__}:compiled_step"),),
)


@pytest.fixture
def with_toy():
    with registered(TOY):
        yield


def test_the_toy_is_a_verb_that_trains(with_toy, tmp_path, corpus, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["toy", "--help"])
    assert done.value.code == 0 and "--workdir" in capsys.readouterr().out
    _, reaches = cli._parser()
    assert reaches["toy"] in cli.training_verbs()  # SIGTERM stops it cleanly from start-up on
    work = tmp_path / "w"
    assert (
        cli.main(
            [
                "toy",
                "--workdir",
                str(work),
                f"--config.data.corpus={corpus}",
                "--config.train.steps=3",
                "--config.train.log_every=1",
                "--config.eval.every_steps=3",
                *SMALL,
            ]
        )
        == 0
    )
    assert json.loads((work / "summary.json").read_text())["step"] == 3
    assert json.loads((work / "run.json").read_text())["stage"] == "toy"
    assert "done: step 3, held-out loss" in capsys.readouterr().out


def test_the_planner_sizes_the_toy_step(with_toy, capsys):
    assert "toy" in step_names()
    assert cli.main(["plan", "--steps", "pretrain,toy", "--target", "v5e-8"]) == 0
    out = capsys.readouterr().out
    assert "\ntoy: mesh data=8 fsdp=1 tensor=1, remat=none, 2 row(s) x 256 per device" in out
    pretrain, toy_table = out.split("\npretrain: ")[1].split("\ntoy: ")
    assert pretrain.splitlines()[1:] == toy_table.splitlines()[1:]  # the same model, the same memory


def test_the_toy_step_compiles_ahead_of_time(with_toy):
    from lm.config import load_config
    from lm.plan.aot import compile_step, target_devices
    from lm.plan.hardware import parse_target
    from lm.plan.memory import estimate

    config = load_config(
        "configs/tiny.py",
        [
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.tensor=2",
            "train.batch_size=8",
            "data.seq_len=64",
            "model.max_seq_len=64",
        ],
    )
    c = compile_step("toy", config, target_devices(parse_target("cpu:8")))
    assert c.error is None and c.arguments > 0
    parts = estimate(config, "toy", 8).parts
    assert abs(c.arguments - (parts["params"] + parts["optimizer"])) / c.arguments < 0.05


def test_a_name_taken_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        register(StageEntry("sft2", "x", "m:f", "finetune", steps=(CompiledStep("sft_lora", "m:f"),)))
    assert "toy" not in step_names()
