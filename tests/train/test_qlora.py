"""QLoRA: a LoRA run whose frozen base holds its layers' weights in 4 bits (model.lora_base_quant).

A step over the 4-bit base equals a LoRA step over the dequantized base; on a (2,2,2) mesh it
equals one device; the 4-bit base reaches the step as packed values and scales; a run split by a
checkpoint equals the straight run bitwise, and exports as a PEFT adapter over its float base."""

import json

import jax
import numpy as np
import pytest

from lm.config import base_config
from lm.model.lora import is_adapter
from lm.model.params import merge_trees
from lm.model.qtensor import QTensor
from lm.train.losses import sft_loss
from lm.train.setup import build_run
from tests.train.test_sft_step import T, V, rows_of

ROWS = [[0, 1], [2, 3], [1], [0], [3, 2], [2], [1, 0], [3]]


def config(quant="nf4", mesh=(1, 1, 1)):
    c = base_config()
    c.model.update(vocab_size=V, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256, max_seq_len=T, lora_rank=4)
    c.model.lora_base_quant = quant
    c.optim.update(lr=1e-2, warmup_steps=0, weight_decay=0.0, eps=1.0)
    c.train.update(batch_size=8, steps=10)
    c.mesh.update(data=mesh[0], fsdp=mesh[1], tensor=mesh[2])
    c.data.seq_len = T
    return c


@pytest.fixture(scope="module")
def base():
    """A float base with weights of a trained model's size (not the zeros of fresh adapters)."""
    plain = base_config()
    plain.model.update(vocab_size=V, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256, max_seq_len=T)
    plain.data.seq_len = T
    return jax.device_get(build_run(plain, sft_loss, devices=jax.devices()[:1]).init(seed=1)[0].params)


def step_of(c, base, devices=None):
    """(loss and adapter gradients, new adapters, metrics, frozen base) of one step from `base`."""
    run = build_run(c, sft_loss, devices=devices or jax.devices()[:1], trainable=is_adapter)
    state, frozen = run.init(seed=3, base=base)
    sig = run.signature(len(ROWS))
    batch = run.placer(sig).from_global(rows_of(ROWS))
    loss = lambda p: run.loss_fn(merge_trees(p, frozen["base"]), batch, {}, None)[0]  # noqa: E731
    value, grads = jax.jit(jax.value_and_grad(loss))(state.params)
    new, metrics = run.bind(run.train_step(sig), frozen)(state, batch)
    return jax.device_get((value, grads)), jax.device_get(new.params), jax.device_get(metrics), frozen["base"]


def dequantized(frozen: dict) -> dict:
    return jax.device_get(
        jax.tree.map(
            lambda x: x.dequantize() if isinstance(x, QTensor) else x, frozen, is_leaf=lambda x: isinstance(x, QTensor)
        )
    )


def close(a, b, rtol=1e-5):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        scale = max(float(np.abs(y).max()), 1e-12)
        np.testing.assert_allclose(x, y, rtol=0, atol=rtol * scale)


@pytest.mark.parametrize("quant", ["nf4", "int4"])
def test_step_over_the_4bit_base_equals_a_lora_step_over_the_dequantized_base(base, quant):
    (loss, grads), new, metrics, frozen = step_of(config(quant), base)
    layers = frozen["blocks"]
    assert all(isinstance(layers["attn"][n], QTensor) for n in ("wq", "wk", "wv", "wo"))
    assert all(isinstance(layers["mlp"][n], QTensor) for n in ("w_gate", "w_up", "w_down"))
    assert (
        layers["mlp"]["w_up"].values.dtype == np.uint8
        and layers["mlp"]["w_up"].code == {"nf4": "nf4", "int4": "int"}[quant]
    )
    assert not isinstance(frozen["embedding"], QTensor)  # the table stays as given, as QLoRA keeps it
    # the same adapters over the base as the 4-bit one decodes to, in float32
    (loss_f, grads_f), new_f, metrics_f, _ = step_of(config("none"), merge_trees(base, dequantized(frozen)))
    np.testing.assert_allclose(loss, loss_f, rtol=1e-5)
    np.testing.assert_allclose(metrics["loss"], metrics_f["loss"], rtol=1e-5)
    close(grads, grads_f)
    close(new, new_f)
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(grads)) > 0  # B's gradients (A's are 0 at B = 0)


def test_the_4bit_base_is_a_quarter_of_the_float_one_in_bytes(base):
    frozen = step_of(config("nf4"), base)[3]
    layers = [q for q in jax.tree.leaves(frozen["blocks"], is_leaf=lambda x: isinstance(x, QTensor))]
    layers = [q for q in layers if isinstance(q, QTensor)]
    assert len(layers) == 7  # wq wk wv wo w_gate w_up w_down
    four = sum(q.nbytes for q in layers)
    floats = sum(int(np.prod(q.shape)) * 4 for q in layers)
    # 4 bits + a uint8 scale per 64 inputs + a float32 per output channel, against float32
    assert four / floats <= (4 + 8 / 64 + 32 / 128) / 32


def test_qlora_step_on_a_mesh_equals_one_device(base):
    (loss, grads), new, metrics, _ = step_of(config("nf4"), base)
    (loss_m, grads_m), new_m, metrics_m, frozen_m = step_of(config("nf4", (2, 2, 2)), base, jax.devices()[:8])
    wq = frozen_m["blocks"]["attn"]["wq"]
    assert len(wq.values.sharding.device_set) == 8 and not wq.values.sharding.is_fully_replicated
    np.testing.assert_allclose(loss, loss_m, rtol=1e-5)
    np.testing.assert_allclose(metrics["loss"], metrics_m["loss"], rtol=1e-5)
    close(grads, grads_m)
    close(new, new_m)


def test_a_bad_base_quant_is_one_line_naming_the_key():
    from lm.config import validate
    from lm.errors import UserError

    c = config("nf4")
    c.model.lora_rank = 0
    with pytest.raises(UserError, match="model.lora_base_quant"):
        validate(c)


@pytest.mark.slow
def test_qlora_run_resumes_exactly_and_exports_a_peft_adapter_over_its_float_base(small_base, tmp_path_factory):
    from lm.cli import main
    from lm.data.synthetic import write_sort_task
    from tests.e2e.test_cli_sft import sft
    from tests.e2e.test_cli_train import final_params

    root, tmp = small_base.parent, tmp_path_factory.mktemp("qlora")
    task = write_sort_task(tmp / "task", n_train=100, n_heldout=8)
    q = ["--config.model.lora_rank=4", "--config.model.lora_base_quant=nf4"]
    straight, split = tmp / "straight", tmp / "split"
    assert sft(root, task, straight, 6, *q) == 0  # held-out answers: adapters folded into the 4-bit base
    assert sft(root, task, split, 5, *q, "--config.checkpoint.every_steps=3", held_out=False) == 0
    assert sft(root, task, split, 6, *q, "--resume", held_out=False) == 0
    a, b = final_params(straight, 6), final_params(split, 6)
    assert all("_lora_" in jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(a)[0])
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
    assert main(["export", "--workdir", str(straight), "--format", "peft", "--out", str(tmp / "adapter")]) == 0
    adapter = json.loads((tmp / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["peft_type"] == "LORA"
    assert (tmp / "adapter" / "adapter_model.safetensors").stat().st_size > 0


def test_merging_adapters_into_a_4bit_base_gives_the_float_model_it_trained_against():
    from lm.model.lora import merge_lora
    from lm.model.quant import quantize

    rng = np.random.default_rng(0)
    w = rng.standard_normal((2, 128, 64)).astype(np.float32)
    a, b = rng.standard_normal((2, 128, 4)).astype(np.float32), rng.standard_normal((2, 4, 64)).astype(np.float32)
    q = quantize(w, 4, -2, 1, group=64, code="nf4", double=True)
    got = merge_lora({"w_up": q, "w_up_lora_a": a, "w_up_lora_b": b, "w_down": q}, 8.0, 4)
    want = merge_lora({"w_up": np.asarray(q.dequantize()), "w_up_lora_a": a, "w_up_lora_b": b}, 8.0, 4)
    np.testing.assert_allclose(got["w_up"], want["w_up"], rtol=1e-6)
    np.testing.assert_array_equal(got["w_down"], np.asarray(q.dequantize()))
