"""Checks of the data settings before any data work, in a fraction of a second.

`check_data_config(config)` finds the mistakes that would otherwise surface after
minutes of curation or tokenizing (or after JAX has started): missing corpora,
a tokenizer that does not exist or does not fit the model, a tokenized directory
made with another tokenizer. It imports neither JAX nor grain nor datatrove.
"""

from __future__ import annotations

import glob
import importlib.util
from pathlib import Path

from lm.config import data_sources
from lm.data.curate.settings import check_config
from lm.data.shards import SPLITS, is_shard_dir, read_manifest
from lm.data.tokenizer import load_tokenizer
from lm.errors import UserError

_GLOB_CHARS = set("*?[")


def source_label(d, i: int) -> str:
    """The config key of the i-th source, for messages."""
    return f"data.sources[{i}]" if d.sources else "data.corpus"


def spm_vocab(name: str) -> int:
    """The vocabulary size of a 'spm:VOCAB' tokenizer name."""
    try:
        return int(name[len("spm:") :])
    except ValueError:
        raise UserError(f"data.tokenizer = '{name}': expected spm:VOCAB_SIZE, e.g. spm:8192") from None


def check_data_config(config) -> None:
    """Raises UserError naming the key if the `data` section cannot work with this model."""
    d, vocab_size = config.data, config.model.vocab_size
    if d.max_train_bytes < 0:
        raise UserError(
            f"config key 'data.max_train_bytes' = {d.max_train_bytes}: expected >= 0 (0 = the whole corpus)"
        )
    specs = data_sources(d)
    tok = _check_tokenizer(d.tokenizer, vocab_size)
    corpora = []
    for i, (spec, _) in enumerate(specs):
        label = source_label(d, i)
        if is_shard_dir(spec):
            if tok is not None:
                _check_shard_dir(spec, label, d.tokenizer, tok)
        else:
            _check_corpus(spec, label)
            corpora.append(spec)
    if tok is None and not corpora:
        raise UserError(
            f"data.tokenizer = '{d.tokenizer}' trains on a corpus, but data.sources holds only "
            "tokenized directories; give their tokenizer's .model instead"
        )
    if d.curate and corpora:
        _check_curation(config.curate)


def _check_tokenizer(name: str, vocab_size: int):
    """The tokenizer (None for 'spm:N', trained later) after checking it fits the model."""
    if name.startswith("spm:"):
        n = spm_vocab(name)
        if not 0 < n <= vocab_size:
            raise UserError(
                f"data.tokenizer = '{name}': a {n}-piece tokenizer needs model.vocab_size >= {n} "
                f"(it is {vocab_size}); lower N or raise --config.model.vocab_size"
            )
        return None
    tok = load_tokenizer(name)  # 'byte' or a .model file; a missing file is reported here
    if tok.vocab_size > vocab_size:
        raise UserError(
            f"data.tokenizer = '{name}' has {tok.vocab_size} ids but model.vocab_size is {vocab_size}; "
            f"set --config.model.vocab_size={tok.vocab_size} (or more)"
        )
    return tok


def _check_corpus(spec: str, label: str) -> None:
    if spec == "stdlib":
        return
    if _GLOB_CHARS & set(spec):
        if next(glob.iglob(spec, recursive=True), None) is None:
            raise UserError(f"{label} = '{spec}': the glob matches no files")
        return
    if not Path(spec).exists():
        raise UserError(
            f"{label} = '{spec}' does not exist; give a directory, a file, a glob, 'stdlib', "
            "or a directory written by `lm tokenize`"
        )


def _check_shard_dir(spec: str, label: str, name: str, tok) -> None:
    want = tok.fingerprint()
    for split in SPLITS:
        got = read_manifest(Path(spec) / split)["tokenizer"]
        if got["fingerprint"] != want:
            raise UserError(
                f"{label} = '{spec}' was tokenized with '{got['name']}' ({got['fingerprint']}), but "
                f"data.tokenizer = '{name}' is {want}; use the tokenizer it was made with, "
                "or tokenize it again"
            )


def _check_curation(curate_cfg) -> None:
    if importlib.util.find_spec("datatrove") is None:
        raise UserError("data.curate=true needs the curation extras: pip install -e '.[curate]'")
    check_config(curate_cfg)
