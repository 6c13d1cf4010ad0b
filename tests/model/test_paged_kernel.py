"""The TPU paged-attention kernel for decode steps (lm.model.paged_kernel), in the TPU interpreter on
CPU: equal to the XLA path on a bfloat16 pool (grouped kv heads, rows of different lengths over a
shuffled page table, the soft cap, a padding row, one device or a mesh); the engine decodes the
tokens of blockwise with it; which calls it takes; and a TPU decode program compiles to it."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from lm.config import load_config, rules_table
from lm.config.mesh import AXES
from lm.infer.engine.engine import Engine, EngineConfig, Request
from lm.infer.sampling import SamplingParams
from lm.model import fused_attention as fused
from lm.model import paged_kernel
from lm.model.attention import paged_attention
from lm.model.layers import Partitioning
from lm.model.paged import Paging, read_pool, slots_and_mask
from lm.model.transformer import Transformer
from tests.model.test_transformer import model_spec, random_params

N, K, H, PS, PAGES, WIDTH = 4, 2, 16, 4, 32, 6  # a table of 6 pages: compute blocks of 2 pages
RULES = rules_table(load_config("configs/tiny.py"))


def decode_inputs(rows: int, seed: int = 0):
    """A bfloat16 pool, queries of one decode step and (read index, mask) of rows at different
    positions over a shuffled page table; the last row is padding (segment 0)."""
    rng = np.random.default_rng(seed)
    pool = lambda: jnp.asarray(rng.normal(size=(K, PAGES * PS, H)), jnp.bfloat16)  # noqa: E731
    k_pool, v_pool = pool(), pool()
    q = jnp.asarray(2 * rng.normal(size=(rows, 1, N, H)), jnp.bfloat16)
    table = jnp.asarray(rng.permutation(np.arange(1, PAGES))[: rows * WIDTH].reshape(rows, WIDTH), jnp.int32)
    pos = jnp.asarray(rng.permutation([0, 5, 13, 23, 9, 17, 2, 11])[:rows, None], jnp.int32)
    seg = jnp.asarray([[1]] * (rows - 1) + [[0]], jnp.int32)
    _, read, mask = slots_and_mask(Paging(PS, PAGES), table, seg, pos)
    return q, k_pool, v_pool, read, mask


def check_against_xla(part, rows, scale, cap):
    q, k_pool, v_pool, read, mask = decode_inputs(rows)
    want = paged_attention(q, read_pool(k_pool, read), read_pool(v_pool, read), mask, scale, cap)
    got = jax.jit(lambda *a: paged_kernel.paged_decode(*a, scale, cap, PS, part))(q, k_pool, v_pool, read, mask)
    assert got.shape == want.shape and got.dtype == jnp.bfloat16
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    # bfloat16-level: the XLA path rounds the probabilities to bfloat16, the kernel keeps them in float32
    np.testing.assert_allclose(got[:-1], want[:-1], rtol=0, atol=2**-6 * np.abs(want).max())
    assert np.all(got[-1] == 0)  # a padding row (length 0) comes out zeros, not NaN


@pytest.mark.parametrize("scale,cap", [(0.0, 0.0), (0.1, 5.0)])
def test_the_kernel_equals_the_xla_path_on_a_bf16_pool(scale, cap):
    check_against_xla(Partitioning(), 5, scale, cap)


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices")
def test_the_kernel_on_a_mesh_splits_rows_and_kv_heads():
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 1, 1, 1, 1, 2), AXES)  # data=2, tensor=2
    check_against_xla(Partitioning(mesh, RULES), 4, 0.0, 0.0)


def engine_tokens(kernel: str):
    spec = model_spec(
        vocab_size=264,
        d_model=32,
        n_layers=2,
        n_heads=N,
        n_kv_heads=K,
        head_dim=8,
        d_ff=64,
        max_seq_len=32,
        init_std=0.5,
        compute_dtype="bfloat16",
        attention=kernel,
    )
    model = Transformer(spec)
    engine = Engine(model, max_len=32, config=EngineConfig(slots=4, page_size=8, pages=13, chunk=16, decode_block=8))
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    prompts = [[5, 9, 13, 2], [7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49], [100, 3]]
    done = engine.run(random_params(model, seed=7), [Request(p, greedy, eos=(-1,)) for p in prompts])
    return [r.ids for r in done], [r.logps for r in done]


def test_the_engine_with_splash_decodes_the_tokens_of_blockwise():
    """A bfloat16 model: prompts prefilled by the XLA path, decode steps through the kernel."""
    (want, want_logps), (got, got_logps) = engine_tokens("blockwise"), engine_tokens("splash")
    assert got == want
    # bfloat16 activations alone move these log-probs by ~0.1 from a float32 model's
    np.testing.assert_allclose(np.concatenate(got_logps), np.concatenate(want_logps), atol=0.15)


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices")
def test_which_calls_the_kernel_takes(monkeypatch):
    part = Partitioning()
    bf16 = jax.ShapeDtypeStruct((K, PAGES * PS, H), jnp.bfloat16)
    q = (4, 1, N, H)
    assert paged_kernel.takes("splash", part, q, bf16, PS, None)
    assert not paged_kernel.takes("splash", part, (4, 3, N, H), bf16, PS, None)  # a prefill chunk
    assert not paged_kernel.takes("splash", part, q, bf16, PS, jnp.bool_(False))  # a model with local layers
    for dtype in (jnp.float32, jnp.int8):  # the kernel computes in bfloat16; int8 scales stay on XLA
        assert not paged_kernel.takes("splash", part, q, jax.ShapeDtypeStruct(bf16.shape, dtype), PS, None)
    for kernel in ("auto", "blockwise", "xla", "flash", "reference"):  # auto on CPU is blockwise
        assert not paged_kernel.takes(kernel, part, q, bf16, PS, None)
    # kv heads that do not split over the devices their query heads split over
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 1, 1, 1, 1, 4), AXES)
    assert not paged_kernel.takes("splash", Partitioning(mesh, RULES), q, bf16, PS, None)
    monkeypatch.setattr(fused, "platform", lambda _: "tpu")
    wide = jax.ShapeDtypeStruct((K, PAGES * PS, 128), jnp.bfloat16)
    assert paged_kernel.takes("auto", part, (4, 1, N, 128), wide, PS, None)
    assert not paged_kernel.takes("auto", part, q, bf16, PS, None)  # head_dim under the TPU's 128 lanes
    assert not paged_kernel.takes("auto", part, (4, 1, N, 128), wide, 8192, None)  # pages past its VMEM


def test_compute_blocks_divide_the_table():
    assert [paged_kernel._block(w, 16) for w in (64, 12, 6, 7)] == [16, 4, 2, 1]
    assert paged_kernel._block(64, 128) == 4 and paged_kernel._block(2, 4096) == 1


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs lm[tpu] (libtpu)")
def test_a_tpu_decode_program_calls_the_kernel():
    """The engine's decode block compiled for a v5e-4 (data=2, tensor=2) by the TPU compiler: with
    model.attention=auto the pool is read by the Pallas kernel (a TPU custom call), with xla not."""
    from lm.plan.aot import compile_step, target_devices
    from lm.plan.hardware import parse_target

    overrides = [
        "model.vocab_size=512",
        "model.d_model=256",
        "model.n_layers=2",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "model.head_dim=128",
        "model.d_ff=512",
        "model.max_seq_len=256",
        "model.compute_dtype=bfloat16",
        "eval.batch_size=4",
        "mesh.data=2",
        "mesh.tensor=2",
    ]
    devices = target_devices(parse_target("v5e-4"))
    for attention, calls in (("auto", True), ("xla", False)):
        built = compile_step(
            "decode", load_config("configs/tiny.py", [*overrides, f"model.attention={attention}"]), devices
        )
        assert built.error is None, built.error
        assert ("tpu_custom_call" in built.compiled.as_text()) == calls
