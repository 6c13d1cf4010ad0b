"""Checks lm.model.counts against published parameter counts and hand-written arithmetic."""

from types import SimpleNamespace

import ml_collections
import pytest

from lm.model import counts
from lm.plan import units


def gpt2_124m():
    return ml_collections.ConfigDict(
        dict(
            vocab_size=50257,
            d_model=768,
            n_layers=12,
            n_heads=12,
            n_kv_heads=12,
            head_dim=0,
            d_ff=3072,
            mlp="gelu",
            norm="layernorm",
            use_bias=True,
            position="learned",
            max_seq_len=1024,
            tie_embeddings=True,
            post_norms=False,
            qk_norm=False,
        )
    )


def llama3(d_model, n_layers, n_heads, d_ff):
    return ml_collections.ConfigDict(
        dict(
            vocab_size=128256,
            d_model=d_model,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=8,
            head_dim=0,
            d_ff=d_ff,
            mlp="swiglu",
            norm="rmsnorm",
            use_bias=False,
            position="rope",
            max_seq_len=8192,
            tie_embeddings=False,
            post_norms=False,
            qk_norm=False,
        )
    )


def tiny(**overrides):
    # d=4, 1 layer, 2 query heads sharing 1 kv head of width 2, vocab 10.
    fields = dict(
        vocab_size=10,
        d_model=4,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        head_dim=0,
        d_ff=8,
        mlp="swiglu",
        norm="rmsnorm",
        use_bias=False,
        position="rope",
        max_seq_len=16,
        tie_embeddings=True,
        post_norms=False,
        qk_norm=False,
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


def test_gpt2_124m_matches_hf_count():
    # Published HF `gpt2` num_parameters(): 124,439,808.
    assert counts.param_count(gpt2_124m()) == 124_439_808


def test_gpt2_124m_non_embedding_by_hand():
    d, ff, L = 768, 3072, 12
    ln = 2 * d  # layernorm scale + bias
    attn = (d * 3 * d + 3 * d) + (d * d + d)  # c_attn (qkv) + c_proj, with biases
    mlp = (d * ff + ff) + (ff * d + d)  # c_fc + c_proj, with biases
    block = 2 * ln + attn + mlp  # = 7,087,872
    expected = L * block + ln  # blocks + ln_f = 85,056,000 (~85M)
    assert expected == 85_056_000
    assert counts.non_embedding_params(gpt2_124m()) == expected
    b = counts.param_breakdown(gpt2_124m())
    assert b["embedding"] == 50257 * 768 and b["position"] == 1024 * 768
    assert b["head"] == 0  # tied
    assert sum(b.values()) == counts.param_count(gpt2_124m())


def test_llama3_8b_and_70b_published_counts():
    assert counts.param_count(llama3(4096, 32, 32, 14336)) == 8_030_261_248
    assert counts.param_count(llama3(8192, 80, 64, 28672)) == 70_553_706_496


def test_gpt2_flops_per_token_formula():
    d, ff, L, H, hd, V, T = 768, 3072, 12, 12, 64, 50257, 1024
    n_matmul = L * (4 * d * d + 2 * d * ff) + d * V  # blocks + (tied) output head
    assert n_matmul == 123_532_032
    expected = 6 * n_matmul + 12 * L * H * hd * T  # 741,192,192 + 113,246,208
    assert counts.flops_per_token(gpt2_124m(), T) == expected == 854_438_400


def test_tiny_flops_every_term():
    # q: 4x(2*2)=16, k: 4x(1*2)=8, v: 8, o: 16 -> 48; swiglu: 3*4*8=96; head 4*10=40.
    n_matmul = 16 + 8 + 8 + 16 + 96 + 40  # = 184
    attn = 12 * 1 * 2 * 2 * 3  # L*H*hd*T at seq_len 3 -> 144
    assert counts.flops_per_token(tiny(), 3) == 6 * n_matmul + attn == 1248
    # Tying, biases, norms and position tables do not change matmul FLOPs.
    assert (
        counts.flops_per_token(tiny(tie_embeddings=False, use_bias=True, position="learned", norm="layernorm"), 3)
        == 1248
    )


def test_tiny_param_count_every_term():
    m = tiny(mlp="gelu", norm="layernorm", use_bias=True, position="learned", tie_embeddings=False)
    emb, pos = 10 * 4, 16 * 4
    attn = (16 + 4) + (8 + 2) + (8 + 2) + (16 + 4)  # q, k, v, o with biases
    mlp = (4 * 8 + 8) + (8 * 4 + 4)  # fc + proj with biases
    norms = 3 * (4 + 4)  # 2 per block + final, scale+bias
    head = 4 * 10
    assert counts.param_count(m) == emb + pos + attn + mlp + norms + head == 304  # 40+64+60+76+24+40
    assert counts.non_embedding_params(m) == 304 - emb - pos


def test_qk_and_post_norms_by_hand():
    m = tiny(post_norms=True, qk_norm=True)  # head_dim 2: one norm over it on q and one on k per block
    plain = counts.param_count(tiny())
    assert counts.param_count(m) == plain + 2 * 4 + 2 * 2
    ln = tiny(norm="layernorm", use_bias=True, qk_norm=True)
    assert counts.param_count(ln) - counts.param_count(tiny(norm="layernorm", use_bias=True)) == 2 * (2 + 2)


@pytest.mark.parametrize(
    "keys",
    [
        dict(),
        dict(qk_norm=True),
        dict(post_norms=True, qk_norm=True, head_dim=24),
        dict(norm="layernorm", use_bias=True),
    ],
)
def test_built_params_are_the_count(keys):
    import flax.linen as nn
    import jax
    import numpy as np

    from lm.config import base_config
    from lm.model.spec import ModelSpec
    from lm.model.transformer import Transformer, init_params

    c = base_config()
    c.model.update(dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48) | keys)
    boxed = jax.eval_shape(lambda k: init_params(Transformer(ModelSpec.from_config(c.model)), k), jax.random.key(0))
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nn.unbox(boxed))) == counts.param_count(c.model)


def test_head_dim_derivation():
    assert counts.head_dim(tiny()) == 2
    assert counts.head_dim(tiny(head_dim=3)) == 3
    assert counts.head_dim(gpt2_124m()) == 64


def test_chinchilla_and_summary():
    assert counts.chinchilla_tokens(gpt2_124m()) == 20 * 124_439_808
    s = units.summary(gpt2_124m(), 1024)
    assert "124,439,808" in s and "attention" in s and "chinchilla" in s


def test_unknown_mlp_rejected():
    with pytest.raises(ValueError):
        counts.param_count(tiny(mlp="relu"))
