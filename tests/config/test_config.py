"""Config loading: schema, dotted overrides, and errors that name the key."""

import pytest

from lm.config import apply_overrides, base_config, load_config, rules_table
from lm.errors import UserError


def write(tmp_path, body: str) -> str:
    path = tmp_path / "cfg.py"
    path.write_text("from lm.config import base_config\n\n" + body)
    return str(path)


@pytest.mark.parametrize("name", ["tiny", "gpt2_124m", "llama3_8b", "llama3_70b"])
def test_shipped_configs_load(name):
    c = load_config(f"configs/{name}.py")
    assert c.model.d_model > 0 and c.data.seq_len <= c.model.max_seq_len


def test_file_values_and_overrides_are_typed(tmp_path):
    path = write(tmp_path, "def get_config():\n    c = base_config()\n    c.optim.lr = 1\n    return c\n")
    c = load_config(
        path,
        [
            "model.n_layers=3",
            "optim.warmup_steps=7",
            "model.tie_embeddings=false",
            "model.mlp=gelu",
            "mesh.rules.embed=fsdp,tensor",
        ],
    )
    assert c.optim.lr == 1.0 and isinstance(c.optim.lr, float)
    assert c.model.n_layers == 3 and c.optim.warmup_steps == 7
    assert c.model.tie_embeddings is False and c.model.mlp == "gelu"
    assert dict(rules_table(c))["embed"] == ("fsdp", "tensor")


def test_partial_config_dict_merges_over_defaults(tmp_path):
    path = write(tmp_path, "def get_config():\n    return {'model': {'n_layers': 2}}\n")
    c = load_config(path)
    assert c.model.n_layers == 2 and c.model.d_model == base_config().model.d_model


@pytest.mark.parametrize(
    "body, words",
    [
        (
            "def get_config():\n    c = base_config()\n    c.model.n_layer = 2\n    return c\n",
            ["model.n_layer", "did you mean 'n_layers'"],
        ),
        (
            "def get_config():\n    c = base_config()\n    c.model.n_layers = 'two'\n    return c\n",
            ["get_config() failed", "n_layers", "two"],
        ),
        ("def get_config():\n    return {'model': {'n_layers': 'two'}}\n", ["model.n_layers", "expected int", "'two'"]),
        (
            "def get_config():\n    c = base_config()\n    c.model.update(d_model=100, n_heads=3)\n    return c\n",
            ["model.n_heads", "must divide model.d_model=100"],
        ),
        (
            "def get_config():\n    c = base_config()\n    c.model.update(n_heads=4, n_kv_heads=3)\n    return c\n",
            ["model.n_kv_heads", "must divide model.n_heads=4"],
        ),
        (
            "def get_config():\n    c = base_config()\n    c.model.mlp = 'relu'\n    return c\n",
            ["model.mlp", "'relu'", "swiglu"],
        ),
        (
            "def get_config():\n    c = base_config()\n    c.train.update(batch_size=10, micro_batches=4)\n    return c\n",  # noqa: E501
            ["train.micro_batches", "batch_size=10"],
        ),
        (
            "def get_config():\n    c = base_config()\n    c.data.seq_len = 4096\n    return c\n",
            ["data.seq_len", "max_seq_len"],
        ),
        (
            "def get_config():\n    c = base_config()\n    c.mesh.rules.embed = ('fsdp', 'pipeline')\n    return c\n",
            ["mesh.rules.embed", "data, stage, fsdp, expert, context, tensor"],
        ),
        ("x = 1\n", ["no get_config"]),
        ("def get_config(:\n", ["failed to load", "SyntaxError"]),
    ],
)
def test_bad_configs_name_the_key(tmp_path, body, words):
    with pytest.raises(UserError) as e:
        load_config(write(tmp_path, body))
    for word in words:
        assert word in str(e.value)


def test_missing_file():
    with pytest.raises(UserError, match="'nope.py' does not exist"):
        load_config("nope.py")


@pytest.mark.parametrize(
    "override, words",
    [
        ("optim.lrr=1", ["optim.lrr", "did you mean 'lr'"]),
        ("optim.learning_rate=1", ["optim.learning_rate", "known keys:", "lr"]),
        ("optim.lr=fast", ["optim.lr", "expected float", "fast"]),
        ("model.tie_embeddings=maybe", ["model.tie_embeddings", "true/false"]),
        ("model=3", ["'model' is a section"]),
        ("optim.lr", ["expected key=value"]),
    ],
)
def test_bad_overrides(override, words):
    with pytest.raises(UserError) as e:
        apply_overrides(base_config(), [override])
    for word in words:
        assert word in str(e.value)
