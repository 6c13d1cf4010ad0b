"""The finetune section: one set of keys for every fine-tuning stage, each stage's own defaults
declared once (its registry entry), the keys that moved here refused in one line naming the new
key, and configs saved before the move read with their values in their new place."""

import pytest

from lm.cli import main
from lm.config import base_config, load_config
from lm.config.finetune import DEFAULTS, LR_FRACTION, OVERRIDES
from lm.config.moved import _FORMER, MOVED, migrate
from lm.errors import UserError
from lm.store.meta import config_from
from lm.train.finetune import finetune_config
from lm.train.identity import differences
from lm.train.registry import stages

FINE_TUNING = [e.name for e in stages() if e.start == "init"]

# each stage's values where they differ from the shared defaults: those of the sections it read before
OWN = {
    "sft": {"epochs": 3.0},
    "distill": {"epochs": 3.0},
    "rl": {"max_skipped_fraction": 0.01},
    "online_dpo": {"max_skipped_fraction": 0.01},
    "rft": {"epochs": 3.0},
}


@pytest.mark.parametrize("stage", FINE_TUNING)
def test_every_stage_resolves_the_shared_section_with_its_own_defaults(stage):
    start = load_config("configs/tiny.py")
    c = finetune_config(start, None, [], stage, init="runs/base", data="train.jsonl")
    assert c.finetune.to_dict() == DEFAULTS | OWN.get(stage, {}) | {"init": "runs/base", "data": "train.jsonl"}
    assert c.optim.lr == pytest.approx(start.optim.lr * LR_FRACTION)
    assert all(c[k.split(".")[0]][k.split(".")[1]] == v for k, v in OVERRIDES.items())


def test_a_config_file_and_overrides_beat_a_stages_own_default(tmp_path):
    path = tmp_path / "ft.py"
    path.write_text(
        "from lm.config import ConfigDict\ndef get_config():\n    return ConfigDict({'finetune': {'epochs': 0.5}})\n"
    )
    start = load_config(None)
    assert finetune_config(start, str(path), [], "sft").finetune.epochs == 0.5
    assert finetune_config(start, None, ["finetune.epochs=2"], "sft").finetune.epochs == 2.0
    assert finetune_config(start, None, [], "rl").rl.epochs == 1  # rl's passes over its rollouts stay rl's


def test_unknown_stage():
    with pytest.raises(ValueError, match="unknown stage 'pairs'"):
        finetune_config(load_config(None), None, [], "pairs")


@pytest.mark.parametrize("old", sorted(k for k in MOVED if "." in k))
def test_a_moved_key_fails_naming_its_new_place(old):
    new = MOVED[old]
    value = base_config().finetune[new.split(".")[1]]
    with pytest.raises(UserError, match=rf"^config key '{old}' moved to '{new}'$"):
        load_config(None, [f"{old}={value}"])


@pytest.mark.parametrize("section, key", [("sft", "epochs"), ("pairs", "truncation"), ("rl", "max_skipped_fraction")])
def test_a_config_file_setting_a_moved_key_fails_naming_its_new_place(tmp_path, section, key):
    path = tmp_path / "old.py"
    path.write_text(
        "from lm.config import ConfigDict\n"
        f"def get_config():\n    return ConfigDict({{'{section}': {{'{key}': {DEFAULTS[key]!r}}}}})\n"
    )
    with pytest.raises(UserError, match=rf"^config key '{section}.{key}' moved to 'finetune.{key}'$"):
        load_config(str(path))
    with pytest.raises(UserError, match=rf"^config key '{section}.{key}' moved to 'finetune.{key}'$"):
        finetune_config(load_config(None), str(path), [], "sft")


def test_the_cli_names_the_new_key(tmp_path, capsys):
    (tmp_path / "config.json").write_text(base_config().to_json())  # a run to start from
    code = main(
        ["sft", "--init", str(tmp_path), "--data", "x.jsonl", "--workdir", str(tmp_path / "w"), "--config.sft.init=x"]
    )
    assert code == 2
    assert (
        capsys.readouterr().err.strip().splitlines()[-1] == "lm: error: config key 'sft.init' moved to 'finetune.init'"
    )


@pytest.mark.parametrize(
    "override, hint",
    [
        ("finetune.epoch=1", "did you mean 'epochs'"),
        ("pairs.eval_pair=1", "did you mean 'eval_pairs'"),
        ("rl.group_sizes=4", "did you mean 'group_size'"),
        ("finetuned.init=x", "did you mean 'finetune'"),
        ("sft.nothing=1", "config key 'sft' moved to 'finetune'"),
    ],
)
def test_unknown_keys_still_suggest(override, hint):
    with pytest.raises(UserError, match=hint):
        load_config(None, [override])


def _saved_before_the_move(used: str, init: str) -> dict:
    """A config.json as a run wrote it before the finetune section: each stage's old section."""
    saved = base_config().to_dict()
    del saved["finetune"]
    old = {"sft": DEFAULTS | {"epochs": 3.0}, "pairs": DEFAULTS, "rl": DEFAULTS | {"max_skipped_fraction": 0.01}}
    for name, keys in _FORMER.items():
        saved[name] = saved.get(name, {}) | {k: old[name][k] for k in keys} | ({"init": init} if name == used else {})
    return saved


@pytest.mark.parametrize("used", ["sft", "pairs", "rl"])
def test_a_config_saved_before_the_move_reads_with_the_used_sections_values(used):
    saved = _saved_before_the_move(used, "runs/base")
    c = config_from(saved, "run")
    assert c.finetune.init == "runs/base"
    assert c.finetune.epochs == {"sft": 3.0, "pairs": 1.0, "rl": 1.0}[used]
    assert c.finetune.max_skipped_fraction == (0.01 if used == "rl" else 0.05)
    assert c.rl.epochs == 1 and c.pairs.eval_pairs == 256
    assert migrate(c.to_dict()) == c.to_dict()  # a config written now is left as it is


def test_a_checkpoint_identity_from_before_the_move_still_resumes():
    saved = {
        "stage": "sft",
        "settings": {"sft.epochs": 3.0, "pairs.epochs": 1.0, "optim.lr": 1e-4},
        "models": {"sft.init": "abc"},
    }
    now = {"stage": "sft", "settings": {"finetune.epochs": 3.0, "optim.lr": 1e-4}, "models": {"finetune.init": "abc"}}
    assert differences(saved, now) == []
    assert differences(saved, now | {"models": {"finetune.init": "other"}}) != []


# a value away from each key's default, of its type
AWAY = {
    "init": "runs/other",
    "data": "other.jsonl",
    "eval_data": "heldout.jsonl",
    "epochs": 7.0,
    "truncation": "cut_response",
    "train_on": "last",
    "on_bad_record": "skip",
    "max_skipped_fraction": 0.5,
    "eval_examples": 3,
    "eval_max_new_tokens": 5,
    "eval_answers": "answers.jsonl",
}


@pytest.mark.parametrize("stage", FINE_TUNING)
def test_a_finetune_key_the_stage_does_not_read_fails_in_one_line(stage):
    entry = next(e for e in stages() if e.name == stage)
    assert set(AWAY) == set(DEFAULTS) and entry.reads and set(entry.reads) <= set(DEFAULTS)
    start = load_config(None)
    for key, value in AWAY.items():
        if key in entry.reads:
            assert finetune_config(start, None, [f"finetune.{key}={value}"], stage).finetune[key] == value
        else:
            with pytest.raises(
                UserError, match=rf"^config key 'finetune.{key}' = .*`lm {entry.command}` does not read"
            ):
                finetune_config(start, None, [f"finetune.{key}={value}"], stage)
    # the default value, as a copied config file would carry it, is no error
    assert finetune_config(start, None, [f"finetune.{k}={DEFAULTS[k]}" for k in ("train_on", "eval_answers")], stage)


def test_what_each_stage_reads():
    reads = {e.name: set(e.reads) for e in stages() if e.start == "init"}
    assert "train_on" not in reads["dpo"] | reads["reward"] | reads["rl"]  # pairs and prompts have no turns to pick
    assert "epochs" not in reads["rl"] and "truncation" not in reads["rl"]  # rl samples its prompts each step
    assert "eval_answers" not in reads["sft"] | reads["reward"] | reads["distill"]
    assert {"eval_examples", "eval_max_new_tokens"} & reads["reward"] == set()
