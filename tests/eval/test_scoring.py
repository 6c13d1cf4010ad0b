"""Scoring against hand computations: perplexity of a uniform model, bits per byte, multiple
choice on a crafted case, calibration, and a (2,2,2) mesh equal to one device."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.config import base_config
from lm.data.tokenizer import load_tokenizer
from lm.eval import choice, sets
from lm.eval.loglik import Scorer, encode_pair, token_bytes
from lm.train.setup import build_run

TOK = load_tokenizer("byte")


def scorer(params=None, mesh=(1, 1, 1), max_seq_len=64, seed=0, batch_size=8):
    c = base_config()
    c.model.update(max_seq_len=max_seq_len, d_model=64, d_ff=128, n_layers=2)
    c.mesh.update(data=mesh[0], fsdp=mesh[1], tensor=mesh[2])
    run = build_run(c, devices=jax.devices()[: math.prod(mesh)])
    if params is None:
        params = run.init(seed=seed)[0].params
    placed = jax.device_put(jax.tree.map(np.asarray, params), run.state_shardings.params)
    return Scorer(run.model, placed, TOK, mesh=run.mesh, rules=run.rules, batch_size=batch_size), params


def uniform():
    s, params = scorer()
    zero = jax.tree.map(jnp.zeros_like, params)  # tied embeddings of zeros: every logit 0
    return scorer(zero)[0]


def test_uniform_model_perplexity_is_the_vocabulary_size(tmp_path):
    (tmp_path / "a.txt").write_text("def f(x):\n    return x * 2\n" * 7)  # > one window: split docs
    s = uniform()
    out = sets.score_set(s, sets.read_set(str(tmp_path / "a.txt"), TOK))
    v = s.model.spec.vocab_size
    assert out["metrics"]["perplexity"] == pytest.approx(v, rel=1e-5)
    assert out["metrics"]["bits_per_byte"] == pytest.approx(math.log2(v), rel=1e-5)
    n = len(("def f(x):\n    return x * 2\n" * 7).encode())
    assert out["metrics"]["tokens"] == n  # n - 1 bytes after the first, then the end of text
    assert out["metrics"]["bytes"] == n - 1  # the end-of-text token spells no byte


def test_bits_per_byte_matches_a_hand_computation(tmp_path):
    text = "héllo wörld, " * 9  # multi-byte characters, three windows of 64
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": text}) + "\n")
    s, params = scorer(seed=3)
    got = sets.score_set(s, sets.read_set(str(tmp_path / "d.jsonl"), TOK))["metrics"]
    ids = np.concatenate([TOK.encode(text), [TOK.eos_id]]).astype(np.int32)
    nats, text_nats, start = 0.0, 0.0, 0
    while start < len(ids) - 1:  # windows of 64 predictions sharing one token
        w = ids[start : start + 65]
        logits = s.model.apply(
            {"params": params}, w[None, :-1], np.ones((1, len(w) - 1), np.int32), np.arange(len(w) - 1)[None]
        )
        logp = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32)))[np.arange(len(w) - 1), w[1:]]
        nats -= logp.sum()
        text_nats -= logp[w[1:] < 256].sum()
        start += 64
    n_bytes = len(text.encode()) - 1
    assert got["bits_per_byte"] == pytest.approx(text_nats / math.log(2) / n_bytes, rel=1e-5)
    assert got["loss"] == pytest.approx(nats / (len(ids) - 1), rel=1e-5)


def test_token_bytes_of_the_byte_tokenizer():
    table = token_bytes(TOK)
    assert table[:256].tolist() == [1] * 256 and table[256:].tolist() == [0, 0, 0]


def test_multiple_choice_picks_the_higher_summed_logprob_and_calibration_by_hand():
    s = uniform()
    v = s.model.spec.vocab_size
    # uniform: log p = -ln V per token; " y" (2 tokens) beats " xx" (3 tokens) on the sum, but per
    # character of the choice " xx" wins (-1.5 ln V against -2 ln V)
    ex = [{"context": "pick", "choices": ["xx", "y"], "answer": 1}]
    out = choice.score_choices(s, ex)
    assert out["metrics"]["acc"] == 1.0 and out["metrics"]["acc_norm"] == 0.0
    p = 1 / (1 + 1 / v)  # softmax of (-3 ln V, -2 ln V)
    assert out["per_example"]["p_answer"][0] == pytest.approx(p, rel=1e-5)
    assert out["metrics"]["ece"] == pytest.approx(1 - p, rel=1e-4)


def test_multiple_choice_agrees_with_direct_scores():
    s, _ = scorer(seed=1)
    ex = [{"context": f"q{i}:", "choices": ["alpha", "be", "gamma ray"], "answer": i % 3} for i in range(5)]
    out = choice.score_choices(s, ex)
    for i, e in enumerate(ex):
        lp = [s.score([encode_pair(TOK, e["context"], " " + c)])[0].logp for c in e["choices"]]
        assert out["per_example"]["acc"][i] == float(np.argmax(lp) == e["answer"])


def test_expected_calibration_error_by_hand():
    # bins of width 0.1: {0.95, 0.97} (accuracy 1/2), {0.55} (accuracy 1)
    ece = choice.expected_calibration_error([0.95, 0.97, 0.55], [1, 0, 1])
    assert ece == pytest.approx(2 / 3 * abs(0.5 - 0.96) + 1 / 3 * abs(1 - 0.55))


def test_fewshot_prompts_are_fixed_by_the_seed_and_never_hold_the_example():
    ex = [{"context": f"c{i}", "choices": ["a", "b"], "answer": i % 2} for i in range(6)]
    a = [choice.fewshot_prefix(ex, i, 3, seed=0) for i in range(6)]
    assert a == [choice.fewshot_prefix(ex, i, 3, seed=0) for i in range(6)]
    assert a != [choice.fewshot_prefix(ex, i, 3, seed=1) for i in range(6)]
    for i, prefix in enumerate(a):
        assert f"c{i} " not in prefix and prefix.count("\n\n") == 3


def test_scores_on_a_2x2x2_mesh_equal_one_device():
    one, params = scorer(seed=2)
    many, _ = scorer(params, mesh=(2, 2, 2))
    reqs = [(TOK.encode("ctx " * k).tolist(), TOK.encode(" cont" * (k + 1)).tolist()) for k in range(1, 11)]
    a, b = one.score(reqs), many.score(reqs)
    np.testing.assert_allclose([x.logp for x in a], [x.logp for x in b], rtol=1e-5)
    assert [x.greedy for x in a] == [x.greedy for x in b]


def test_long_requests_keep_the_continuation_and_say_they_were_cut():
    s, _ = scorer()
    out = s.score([([1] * 100, [2, 3, 4])])[0]
    assert out.truncated and out.tokens == 3


def test_token_shards_are_read_as_stored_and_a_limit_cuts_the_last_document(tmp_path, corpus):
    from lm.data.shards import open_shards, tokenize_corpus

    tokenize_corpus(str(corpus), tmp_path / "out", "byte", 0.25, workers=1, progress=False)
    held = open_shards(tmp_path / "out" / "heldout", TOK)
    for spec in (tmp_path / "out", tmp_path / "out" / "heldout"):  # the output dir means its held-out split
        docs = sets.read_set(str(spec), TOK)
        assert len(docs.ids) == held.n_docs and np.array_equal(docs.ids[0], held.doc(0))
    first = len(held.doc(0))
    cut = sets.read_set(str(tmp_path / "out"), TOK, max_tokens=first // 2)
    assert [len(d) for d in cut.ids] == [first // 2] and cut.truncated == held.n_docs - 1
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": "x" * 9}) + "\n" for _ in range(3)))
    cut = sets.read_set(str(tmp_path / "d.jsonl"), TOK, max_tokens=15)  # 10 tokens each, the EOS included
    assert [len(d) for d in cut.ids] == [10, 5] and cut.example_ids == [1, 2] and cut.truncated == 1


@pytest.fixture(scope="module")
def spm_models(tmp_path_factory):
    """A small BPE as `lm` trains them, and the same pieces with a dummy prefix (as Llama's)."""
    import sysconfig
    from pathlib import Path

    from sentencepiece import sentencepiece_model_pb2

    from lm.data.spm import SentencePieceTokenizer, train_sentencepiece

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = [(stdlib / name).read_text() for name in ("abc.py", "bisect.py", "colorsys.py", "heapq.py")]
    ours = train_sentencepiece(docs, tmp_path_factory.mktemp("spm") / "tok", vocab_size=400)
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(ours.path.read_bytes())
    proto.normalizer_spec.add_dummy_prefix = True
    prefixed = ours.path.with_name("prefixed.model")
    prefixed.write_bytes(proto.SerializeToString())
    return ours, SentencePieceTokenizer(prefixed)


TEXTS = [
    "def f(x):\n    return x  # the end\n",
    "a \u2581 b\u2581\u2581c \u2581the",
    "h\u00e9llo w\u00f6rld \u65e5\u672c \U0001f642\t\r\n",
    "\u2581",
    "  \n\n\t  x",
    "x\u2581" + "\ue000 \ue001",
]


def test_token_bytes_of_sentencepiece_pieces_by_hand(spm_models):
    ours, prefixed = spm_models
    for tok in (ours, prefixed):
        sp, table = tok._sp, token_bytes(tok)
        piece = {sp.id_to_piece(i): i for i in range(tok.vocab_size)}
        # "\u2581" in a piece is the space it stands for, leading one included (the dummy prefix
        # is dropped only at the very start of a text); byte pieces are one byte; controls none
        assert table[piece["\u2581"]] == 1 and table[piece["\u2581\u2581"]] == 2 and table[piece["\u2581heap"]] == 5
        assert table[piece["<0xE2>"]] == 1 and table[piece["\n"]] == 1 and table[piece[")\n"]] == 2
        assert table[[tok.bos_id, tok.eos_id, tok.pad_id, sp.unk_id(), piece["<|user|>"]]].tolist() == [0] * 5
    # a literal "\u2581" in the text is its three bytes, as byte pieces: it decodes back as itself
    ids = ours.encode("a\u2581b")
    assert [ours._sp.id_to_piece(int(i)) for i in ids] == ["a", "<0xE2>", "<0x96>", "<0x81>", "b"]
    assert token_bytes(ours)[ids].tolist() == [1, 1, 1, 1, 1]


def test_token_bytes_add_up_to_the_bytes_of_the_text(spm_models):
    ours, prefixed = spm_models
    for text in TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids) == text
        assert int(token_bytes(ours)[ids].sum()) == len(text.encode("utf-8")), text
        # a dummy-prefix model spells one space more than the text at its start, and no other
        ids = prefixed.encode(text)
        assert prefixed.decode(ids) == text
        assert int(token_bytes(prefixed)[ids].sum()) == len(text.encode("utf-8")) + 1, text
