"""KV-cache generation: the tokens of recomputing the full forward pass, batch-independent rows,
EOS and stop strings, and a (2,2,2) mesh equal to one device."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.config import base_config, rules_table
from lm.data.tokenizer import ByteTokenizer
from lm.errors import UserError
from lm.infer.generate import Generator
from lm.infer.sampling import SamplingParams
from lm.infer.text import complete
from lm.model.layers import Partitioning
from lm.model.transformer import Transformer
from lm.sharding import make_mesh, param_shardings
from tests.model.test_transformer import model_spec, random_params

SPEC = model_spec(
    vocab_size=264, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, max_seq_len=40, init_std=0.3
)
PROMPTS = [[5, 9, 13, 2], [7], [40, 41, 42, 43, 44, 45, 46, 47, 48], [100, 3]]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0)


@functools.cache
def model_params():
    model = Transformer(SPEC)
    return model, random_params(model, seed=7)


def recompute_greedy(prompt, n):
    """The reference: the whole sequence through the training forward pass for every new token (a
    fixed-width buffer, padding as segment 0 after the text, so it compiles once)."""
    model, params = model_params()
    width = SPEC.max_seq_len
    fwd = jax.jit(lambda p, x, seg: model.apply({"params": p}, x, seg, jnp.arange(width)[None]))
    seq, logps = list(prompt), []
    for _ in range(n):
        ids, seg = np.zeros((1, width), np.int32), np.zeros((1, width), np.int32)
        ids[0, : len(seq)], seg[0, : len(seq)] = seq, 1
        logits = fwd(params, jnp.asarray(ids), jnp.asarray(seg))[0, len(seq) - 1]
        seq.append(int(jnp.argmax(logits)))
        logps.append(float(jax.nn.log_softmax(logits)[seq[-1]]))
    return seq[len(prompt) :], logps


def test_greedy_with_the_cache_gives_the_tokens_of_recomputing_everything():
    model, params = model_params()
    result = Generator(model, params, GREEDY, eos_id=-1)(PROMPTS)
    for prompt, ids, logp, finish in zip(PROMPTS, result.ids, result.logprobs, result.finish):
        ref_ids, ref_logp = recompute_greedy(prompt, 12)
        assert ids.tolist() == ref_ids
        np.testing.assert_allclose(logp, ref_logp, atol=1e-4)
        assert finish == "length"
    assert len({tuple(i) for i in result.ids}) == len(PROMPTS)  # the rows really differ


def test_each_row_equals_the_row_run_alone():
    model, params = model_params()
    batch = Generator(model, params, GREEDY, eos_id=-1)(PROMPTS)
    for r, prompt in enumerate(PROMPTS):
        alone = Generator(model, params, GREEDY, eos_id=-1)([prompt])
        np.testing.assert_array_equal(alone.ids[0], batch.ids[r])
        np.testing.assert_allclose(alone.logprobs[0], batch.logprobs[r], atol=1e-5)


def test_eos_stops_only_its_row_and_sampling_is_seeded():
    model, params = model_params()
    free = Generator(model, params, GREEDY, eos_id=-1)(PROMPTS)
    eos = int(free.ids[0][3])  # row 0's fourth token becomes the end of sequence
    stopped = Generator(model, params, GREEDY, eos_id=eos)(PROMPTS)
    first = int(np.flatnonzero(free.ids[0] == eos)[0])
    assert stopped.ids[0].tolist() == free.ids[0][: first + 1].tolist() and stopped.finish[0] == "eos"
    for r in range(1, len(PROMPTS)):
        hit = np.flatnonzero(free.ids[r] == eos)
        expected = free.ids[r][: hit[0] + 1] if len(hit) else free.ids[r]
        assert stopped.ids[r].tolist() == expected.tolist()
    hot = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=4)
    a, b = (Generator(model, params, hot, eos_id=-1)(PROMPTS) for _ in range(2))
    assert all(np.array_equal(x, y) for x, y in zip(a.ids, b.ids))
    c = Generator(model, params, dataclasses.replace(hot, seed=5), eos_id=-1)(PROMPTS)
    assert not all(np.array_equal(x, y) for x, y in zip(a.ids, c.ids))


def test_stop_strings_and_streaming_cut_the_text():
    model, params = model_params()
    tok = ByteTokenizer()
    prompts = ["def f", "x = 1"]
    sampling = SamplingParams(max_new_tokens=16, temperature=0)
    free = complete(Generator(model, params, sampling, eos_id=tok.eos_id), tok, prompts)
    text = free[0]["text"]
    assert len(text) >= 6
    stop = text[3:5]
    pieces = []
    cut = complete(
        Generator(model, params, sampling, eos_id=tok.eos_id), tok, prompts, stop=(stop,), stream=pieces.append
    )
    assert cut[0]["text"] == text[: text.find(stop)] and cut[0]["finish_reason"] == "stop"
    assert "".join(pieces) == cut[0]["text"]
    assert tok.decode(cut[0]["ids"]).startswith(cut[0]["text"]) and stop in tok.decode(cut[0]["ids"])
    other = free[1]["text"]
    assert cut[1]["text"] == (other[: other.find(stop)] if stop in other else other)


def test_bad_prompts_are_one_clear_line():
    model, params = model_params()
    gen = Generator(model, params, SamplingParams(max_new_tokens=30), eos_id=-1)
    with pytest.raises(UserError, match="prompt 1: empty"):
        gen([[1, 2], []])
    with pytest.raises(UserError, match="at most 10 new tokens fit"):
        gen([[1] * 30])
    with pytest.raises(UserError, match="longer than the model's context of 40"):
        gen([[1] * 45])
    with pytest.raises(UserError, match="exceeds the model's context"):
        Generator(model, params, GREEDY, eos_id=-1, max_len=41)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
def test_decoding_on_a_2x2x2_mesh_equals_one_device():
    model, params = model_params()
    one = Generator(model, params, GREEDY, eos_id=-1)(PROMPTS)
    rules = rules_table(base_config())
    mesh = make_mesh(dict(data=2, fsdp=2, tensor=2))
    sharded_model = Transformer(SPEC, Partitioning(mesh, rules))
    boxed = jax.eval_shape(lambda k: sharded_model.init(k, *(jnp.zeros((1, 4), jnp.int32),) * 3), jax.random.PRNGKey(0))
    placed = jax.device_put(params, param_shardings(boxed["params"], mesh, rules))
    assert len(placed["blocks"]["attn"]["wq"].sharding.device_set) == 8
    gen = Generator(sharded_model, placed, GREEDY, eos_id=-1, mesh=mesh, rules=rules)
    sharded = gen(PROMPTS[:3])  # 3 prompts: padded to the 4 batch shards
    for r in range(3):
        np.testing.assert_array_equal(sharded.ids[r], one.ids[r])
        np.testing.assert_allclose(sharded.logprobs[r], one.logprobs[r], atol=1e-4)
