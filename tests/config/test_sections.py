"""The config by section: each section's defaults live once (the schema is their union, and the
frozen dataclasses consumers read take every value from their section), the distill section's
checks name the key, and lm.config loads without jax."""

import dataclasses
import pathlib
import subprocess
import sys

import pytest

import lm.config
from lm.config import SECTIONS, base_config, load_config, validate
from lm.config.dpo import DpoSettings
from lm.config.rl import RlSettings
from lm.config.sft import SftSettings
from lm.errors import UserError

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_schema_is_the_union_of_the_sections_defaults():
    c = base_config()
    assert set(c.keys()) == set(SECTIONS)
    for name, section in SECTIONS.items():
        assert c[name].to_dict() == section.DEFAULTS, name
    validate(c)  # every default is allowed and consistent
    assert all(key.split(".")[0] in SECTIONS for key in lm.config.CHOICES)


def test_the_schema_is_a_fresh_copy():
    c = base_config()
    c.mesh.rules.embed = ("tensor",)
    c.curate.language.keep = ("fr",)
    assert base_config().mesh.rules.embed == ("fsdp",) and base_config().curate.language.keep == ("en",)


def _other(value):
    """A different value of the same type."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    return value + "_x"


@pytest.mark.parametrize("cls, name", [(DpoSettings, "dpo"), (RlSettings, "rl")])
def test_loss_settings_read_every_field_from_their_section(cls, name):
    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(cls)), "defaults live in the section"
    section = base_config()[name]
    assert dataclasses.asdict(cls.from_config(section)) == {f.name: section[f.name] for f in dataclasses.fields(cls)}
    for f in dataclasses.fields(cls):  # each field comes from its key
        changed = base_config()[name]
        changed[f.name] = _other(changed[f.name])
        assert getattr(cls.from_config(changed), f.name) == changed[f.name], f.name


def test_sft_settings_defaults_are_the_finetune_sections():
    sft = base_config().finetune
    s = SftSettings.from_config(sft, seq_len=96)
    assert s == SftSettings(seq_len=96)  # the field defaults are the section's
    assert dataclasses.asdict(s) == {"seq_len": 96} | {f.name: sft[f.name] for f in dataclasses.fields(s)[1:]}
    for f in dataclasses.fields(s)[1:]:
        changed = base_config().finetune
        changed[f.name] = _other(changed[f.name])
        assert getattr(SftSettings.from_config(changed, 96), f.name) == changed[f.name], f.name


def test_model_spec_reads_the_model_section_and_derives_head_dim_once():
    from lm.model import counts
    from lm.model import spec as specs

    m = base_config().model
    spec = specs.ModelSpec.from_config(m)
    parts = [getattr(spec, name) for name in specs.PARTS]
    assert all(f.default is dataclasses.MISSING for x in [spec, *parts] for f in dataclasses.fields(x))
    read = [(f.name, getattr(spec, f.name)) for f in dataclasses.fields(spec) if f.name not in specs.PARTS]
    for name, part in zip(specs.PARTS, parts):  # a part's field from its key (CONFIG_KEYS where renamed)
        read += [(specs.CONFIG_KEYS[name].get(k, k), v) for k, v in dataclasses.asdict(part).items()]
    assert len(read) == len(dict(read)), "each key read once"
    # "family": where it came from; lora_base_quant: how a run holds the base (lm.train.setup)
    section = {k: v for k, v in m.to_dict().items() if k not in ("family", "lora_base_quant")}
    assert dict(read) == section | {"head_dim": m.d_model // m.n_heads, "expert_d_ff": m.d_ff}
    assert counts.head_dim is specs.head_dim  # the model's one derivation; the config's checks agree:
    assert counts.head_dim(m) == lm.config.model.head_dim(m) == m.d_model // m.n_heads


def test_settings_keep_their_old_homes():
    from lm.data import sft
    from lm.data.curate import settings
    from lm.train import pair_losses, rl_losses

    assert (pair_losses.DpoSettings, rl_losses.RlSettings, sft.SftSettings) == (DpoSettings, RlSettings, SftSettings)
    assert settings.check_config is lm.config.curate.check_config


def test_one_require():
    defined = [p.relative_to(ROOT).as_posix() for p in (ROOT / "lm").rglob("*.py") if "def require(" in p.read_text()]
    assert defined == ["lm/config/core.py"]


@pytest.mark.parametrize(
    "override, key",
    [
        ("distill.divergence=kl", "distill.divergence"),
        ("distill.beta=1.5", "distill.beta"),
        ("distill.beta=-0.1", "distill.beta"),
        ("distill.beta=nan", "distill.beta"),
        ("distill.temperature=0", "distill.temperature"),
        ("distill.temperature=inf", "distill.temperature"),
        ("train.sample_tokens=-1", "train.sample_tokens"),
    ],
)
def test_checks_name_the_key(override, key):
    with pytest.raises(UserError, match=rf"^config key '{key}' = "):
        load_config(None, [override])


def test_no_closing_sample_is_a_valid_setting():
    assert load_config(None, ["train.sample_tokens=0"]).train.sample_tokens == 0


def test_distill_defaults():
    d = load_config(None, ["distill.teacher=runs/teacher", "distill.divergence=jsd", "distill.beta=1"]).distill
    assert (d.teacher, d.divergence, d.beta, d.temperature) == ("runs/teacher", "jsd", 1.0, 1.0)
    assert lm.config.init_of(load_config(None, ["finetune.init=runs/student"])) == "runs/student"


def test_the_config_loads_without_jax():
    code = (
        "import sys, lm.config; lm.config.load_config('configs/tiny.py'); "
        "assert not {'jax', 'flax', 'numpy'} & set(sys.modules), sorted(sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
