"""The frozen config: what load_config returns and the code below the CLI reads."""

import copy
import dataclasses
import json
import pickle

import pytest

from lm.config import SECTIONS, Config, base_config, freeze, load_config, thaw, with_values
from lm.config.core import apply_overrides, load_file, merge
from lm.errors import UserError
from lm.store.meta import config_from


def test_load_config_returns_frozen_typed_sections():
    c = load_config("configs/tiny.py", ["train.steps=3", "mesh.rules.embed=fsdp,tensor"])
    assert isinstance(c, Config)
    assert [f.name for f in dataclasses.fields(c)] == list(SECTIONS)
    fields = {f.name: f.type for f in dataclasses.fields(c.train)}
    assert fields["steps"] is int and fields["spike_threshold"] is float and fields["on_bad"] is str
    assert c.train.steps == 3 and c.mesh.rules["embed"] == ("fsdp", "tensor")
    assert type(c.curate.c4).__name__ == "CurateC4"  # nested sections are classes of their own
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.train.steps = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.train = c.optim


def test_frozen_holds_the_values_of_the_built_config():
    built = base_config()
    merge(built, load_file("configs/gpt2_124m.py"))
    apply_overrides(built, ["optim.lr=3e-4", "data.sources=a.txt:2,b.txt"])
    frozen = freeze(built)
    assert json.loads(frozen.to_json()) == json.loads(built.to_json())
    assert frozen.to_dict() == built.to_dict()
    assert freeze(frozen) is frozen
    assert freeze(thaw(frozen)) == frozen


def test_frozen_config_pickles_and_copies():
    c = load_config("configs/tiny.py", ["model.lora_rank=4"])
    assert pickle.loads(pickle.dumps(c)) == c
    assert copy.deepcopy(c) == c


def test_with_values_is_a_checked_copy():
    c = load_config("configs/tiny.py")
    d = with_values(c, {"train.steps": 7, "optim.lr": 1, "model": c.model.to_dict() | {"n_layers": 2}})
    assert (d.train.steps, d.optim.lr, d.model.n_layers) == (7, 1.0, 2) and isinstance(d.optim.lr, float)
    assert c.train.steps != 7 and c.model.n_layers != 2  # the given config is unchanged
    with pytest.raises(UserError, match=r"unknown config key 'train.stepz' \(did you mean 'steps'\?\)"):
        with_values(c, {"train.stepz": 7})
    with pytest.raises(UserError, match=r"config key 'train.steps': expected int, got 'x' \(str\)"):
        with_values(c, {"train.steps": "x"})


def test_a_saved_run_config_reads_frozen():
    saved = json.loads(load_config("configs/tiny.py", ["train.steps=9"]).to_json())
    c = config_from(saved, "run 'x'")
    assert isinstance(c, Config) and c.train.steps == 9
    assert c.model.lora_targets == tuple(saved["model"]["lora_targets"])  # JSON lists read back as tuples
