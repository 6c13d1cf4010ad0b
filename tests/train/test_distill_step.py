"""Distillation through the real train step: the teacher is a frozen model of another shape held
beside the student (never trained, never in the state); a teacher equal to the student gives zero
loss and zero gradient; a (2,2,2) mesh equals one device."""

import jax
import numpy as np
import pytest

from lm.config import base_config, rules_table
from lm.model.build import build_model
from lm.train.distill_losses import distill_loss
from lm.train.setup import FrozenSlot, build_run

T, V = 64, 96


def config(d_model=16, n_layers=2, rows=4, **distill):
    c = base_config()
    c.model.update(
        vocab_size=V, d_model=d_model, n_layers=n_layers, n_heads=4, n_kv_heads=2, d_ff=2 * d_model, max_seq_len=T
    )
    c.optim.update(lr=1e-2, warmup_steps=0, weight_decay=0.0, eps=1.0)
    c.train.update(batch_size=rows, steps=10)
    c.data.seq_len = T
    return c


def batch(rows=4, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, V, (rows, T + 1)).astype(np.int32)
    mask = np.zeros((rows, T), np.float32)
    mask[:, T // 3 :] = 1.0  # the "response": the prompt part is not distilled
    return {
        "inputs": ids[:, :-1],
        "targets": ids[:, 1:],
        "loss_mask": mask,
        "segment_ids": np.ones((rows, T), np.int32),
        "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (rows, T)).copy(),
    }


def teacher_params(c, seed=7):
    run = build_run(c, devices=jax.devices()[:1])
    return jax.device_get(run.init_state(seed=seed).params)


def distill_step(student, teacher_config, teacher, devices, kind="forward_kl", beta=0.5, temperature=1.0):
    slot = lambda mesh: FrozenSlot(build_model(teacher_config, rules=rules_table(teacher_config), mesh=mesh))  # noqa: E731
    run = build_run(
        student, lambda m: distill_loss(m, kind, beta, temperature), devices=devices, frozen={"teacher": slot}
    )
    state, frozen = run.init(seed=3, sources={"teacher": teacher})
    assert set(frozen) == {"teacher"} and "teacher" not in state.params
    step = run.bind(run.train_step(), frozen)
    state, metrics = step(state, run.placer().from_global(batch(student.train.batch_size)))
    return jax.device_get(state.params), jax.device_get(metrics), run


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_a_teacher_equal_to_the_student_gives_zero_loss_and_gradient(kind):
    c = config()
    same = jax.device_get(build_run(c, devices=jax.devices()[:1]).init_state(seed=3).params)
    _, m, _ = distill_step(c, c, same, jax.devices()[:1], kind=kind, temperature=2.0)
    assert abs(float(m["loss"])) < 1e-6 and float(m["grad_norm"]) < 1e-5
    assert float(m["top1_agreement"]) == pytest.approx(1.0)
    assert float(m["nll"]) > 1.0  # the student's own response loss is not the objective


def test_a_wider_deeper_teacher_on_a_2x2x2_mesh_equals_one_device():
    student, tc = config(d_model=16, n_layers=2), config(d_model=32, n_layers=3)
    teacher = teacher_params(tc)
    one, m1, run = distill_step(student, tc, teacher, jax.devices()[:1], kind="jsd", beta=0.3)
    assert run.frozen["teacher"].built.spec.d_model == 32 and run.spec.d_model == 16
    assert float(m1["loss"]) > 1e-4 and float(m1["grad_norm"]) > 0  # random models: near-uniform, but apart
    s8 = config(d_model=16, n_layers=2)
    s8.mesh.update(data=2, fsdp=2, tensor=2)
    t8 = config(d_model=32, n_layers=3)
    t8.mesh.update(data=2, fsdp=2, tensor=2)
    eight, m8, _ = distill_step(s8, t8, teacher, jax.devices()[:8], kind="jsd", beta=0.3)
    for k in ("loss", "nll", "grad_norm", "top1_agreement"):
        assert float(m8[k]) == pytest.approx(float(m1[k]), rel=1e-5, abs=1e-6), k
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), one, eight)


def test_teacher_params_of_another_model_are_refused_by_name():
    student, tc = config(), config(d_model=32)
    wrong = teacher_params(config(d_model=16))
    with pytest.raises(Exception, match="frozen model 'teacher' does not fit the model"):
        distill_step(student, tc, wrong, jax.devices()[:1])
