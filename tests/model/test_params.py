"""The built model's params: count equals lm.model.counts.param_count; logical axis annotations."""

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from lm.config import base_config, load_config
from lm.model import counts
from lm.model.spec import ModelSpec
from lm.model.transformer import Transformer, init_params
from tests.model.test_transformer import model_spec


def abstract_params(spec: ModelSpec):
    """Boxed params as ShapeDtypeStructs: no memory, no compute."""
    model = Transformer(spec)
    return jax.eval_shape(lambda key: init_params(model, key), jax.random.key(0))


def built_count(model_config) -> int:
    # cudnn attention cannot be traced on CPU; the attention kernel has no params anyway.
    spec = ModelSpec.from_config(model_config).replace(attention=dict(kernel="xla"))
    leaves = jax.tree.leaves(nn.unbox(abstract_params(spec)))
    return sum(int(np.prod(x.shape)) for x in leaves)


@pytest.mark.parametrize(
    "path, published",
    [
        ("configs/gpt2_124m.py", 124_439_808),
        ("configs/llama3_8b.py", 8_030_261_248),
    ],
)
def test_param_count_matches_published_and_plan(path, published):
    m = load_config(path).model
    assert counts.param_count(m) == published
    assert built_count(m) == published


def test_param_count_every_option_on():
    c = base_config()
    c.model.update(
        vocab_size=50,
        d_model=32,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        head_dim=12,
        d_ff=48,
        mlp="gelu",
        norm="layernorm",
        use_bias=True,
        position="learned",
        max_seq_len=20,
        tie_embeddings=False,
    )
    assert built_count(c.model) == counts.param_count(c.model)
    c.model.update(mlp="swiglu", norm="rmsnorm", use_bias=False, position="rope", tie_embeddings=True)
    assert built_count(c.model) == counts.param_count(c.model)


@pytest.fixture(scope="module")
def specs():
    spec = model_spec(
        vocab_size=50,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        d_ff=48,
        position="learned",
        tie_embeddings=False,
        use_bias=True,
    )
    return nn.get_partition_spec(abstract_params(spec))


@pytest.mark.parametrize(
    "path, names",
    [
        ("embedding", ("vocab", "embed")),
        ("head", ("embed", "vocab")),
        ("pos_embedding", ("position", "embed")),
        ("blocks/attn/wq", ("layers", "embed", "q_heads", "head_dim")),
        ("blocks/attn/wk", ("layers", "embed", "kv_heads", "head_dim")),
        ("blocks/attn/wv", ("layers", "embed", "kv_heads", "head_dim")),
        ("blocks/attn/wo", ("layers", "q_heads", "head_dim", "embed")),
        ("blocks/attn/wq_bias", ("layers", "q_heads", "head_dim")),
        ("blocks/mlp/w_gate", ("layers", "embed", "mlp")),
        ("blocks/mlp/w_down", ("layers", "mlp", "embed")),
        ("blocks/attn_norm/scale", ("layers", "norm")),
        ("final_norm/scale", ("norm",)),
    ],
)
def test_logical_partition_names(specs, path, names):
    node = specs
    for key in path.split("/"):
        node = node[key]
    assert node == P(*names)


def test_scanned_params_have_leading_layer_axis():
    spec = model_spec(vocab_size=50, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48)
    p = nn.unbox(abstract_params(spec))
    assert p["blocks"]["attn"]["wq"].shape == (3, 32, 4, 8)
    assert p["blocks"]["mlp"]["w_down"].shape == (3, 48, 32)
