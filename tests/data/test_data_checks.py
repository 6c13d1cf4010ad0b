"""Data settings checked before any data work: each mistake gets one line naming its key."""

import subprocess
import sys

import pytest

from lm.config import load_config
from lm.data.checks import check_data_config
from lm.data.prepare import prepare_pretrain_data
from lm.data.shards import tokenize_corpus
from lm.data.spm import train_sentencepiece
from lm.errors import UserError


def cfg(*overrides):
    return load_config(
        "configs/tiny.py", ["data.curate=false", "data.tokenizer=byte", "model.vocab_size=264", *overrides]
    )


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory, corpus):
    docs = [p.read_text() for p in sorted(corpus.iterdir())]
    return train_sentencepiece(docs, tmp_path_factory.mktemp("spm") / "tok", 400).path


def test_a_good_config_passes_without_jax_grain_or_datatrove(corpus):
    code = (
        "import sys; from lm.config import load_config; from lm.data.checks import check_data_config; "
        f"check_data_config(load_config('configs/tiny.py', ['data.corpus={corpus}'])); "
        "print(sorted(m for m in ('jax', 'grain', 'datatrove') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_missing_corpus_names_data_corpus(tmp_path):
    with pytest.raises(UserError, match=rf"^data.corpus = '{tmp_path}/nope' does not exist"):
        check_data_config(cfg(f"data.corpus={tmp_path}/nope"))


def test_missing_source_names_its_index(tmp_path, corpus):
    with pytest.raises(UserError, match=rf"^data.sources\[1\] = '{tmp_path}/nope' does not exist"):
        check_data_config(cfg(f"data.sources={corpus}:2,{tmp_path}/nope:1"))
    with pytest.raises(UserError, match=r"^data.sources\[0\] = '.*/\*.xyz': the glob matches no files"):
        check_data_config(cfg(f"data.sources={tmp_path}/*.xyz"))


def test_curating_a_missing_corpus_names_the_config_key_not_the_cli_flag(tmp_path):
    pytest.importorskip("datatrove")
    c = cfg(f"data.corpus={tmp_path}/nope", "data.curate=true")
    with pytest.raises(UserError, match=rf"^data.corpus = '{tmp_path}/nope' does not exist") as e:
        prepare_pretrain_data(c.data, tmp_path / "cache", progress=False, curate_cfg=c.curate)
    assert "--input" not in str(e.value)


def test_tokenizer_model_must_exist(tmp_path, corpus):
    with pytest.raises(UserError, match=r"^data.tokenizer: sentencepiece model '.*/gone.model' does not exist"):
        check_data_config(cfg(f"data.corpus={corpus}", f"data.tokenizer={tmp_path}/gone.model"))


def test_tokenizer_must_fit_the_model(corpus, spm_model):
    with pytest.raises(
        UserError,
        match=r"^data.tokenizer = 'spm:4096': a 4096-piece tokenizer needs "
        r"model.vocab_size >= 4096 \(it is 264\)",
    ):
        check_data_config(cfg(f"data.corpus={corpus}", "data.tokenizer=spm:4096"))
    with pytest.raises(UserError, match=rf"^data.tokenizer = '{spm_model}' has 400 ids but model.vocab_size is 264"):
        check_data_config(cfg(f"data.corpus={corpus}", f"data.tokenizer={spm_model}"))
    with pytest.raises(UserError, match="^data.tokenizer = 'byte' has 259 ids but model.vocab_size is 100"):
        check_data_config(cfg(f"data.corpus={corpus}", "model.vocab_size=100"))
    check_data_config(cfg(f"data.corpus={corpus}", f"data.tokenizer={spm_model}", "model.vocab_size=400"))
    check_data_config(cfg(f"data.corpus={corpus}", "data.tokenizer=spm:264"))


def test_tokenized_dir_must_match_the_tokenizer(tmp_path, corpus, spm_model):
    tokenize_corpus(str(corpus), tmp_path / "byte_shards", "byte", 0.25, progress=False)
    check_data_config(cfg(f"data.sources={tmp_path}/byte_shards"))
    with pytest.raises(
        UserError,
        match=r"^data.sources\[1\] = '.*/byte_shards' was tokenized with 'byte' "
        r"\(byte-v1.*\), but data.tokenizer = '.*tok.model' is spm:",
    ):
        check_data_config(
            cfg(
                f"data.sources={corpus}:1,{tmp_path}/byte_shards:1",
                f"data.tokenizer={spm_model}",
                "model.vocab_size=400",
            )
        )
    with pytest.raises(UserError, match="^data.tokenizer = 'spm:300' trains on a corpus, but data.sources holds only"):
        check_data_config(cfg(f"data.sources={tmp_path}/byte_shards", "data.tokenizer=spm:300", "model.vocab_size=300"))


def test_curation_settings_are_checked_up_front(corpus):
    pytest.importorskip("datatrove")
    with pytest.raises(UserError, match=r"^config key 'curate.near_dedup.bands' = 0"):
        check_data_config(cfg(f"data.corpus={corpus}", "data.curate=true", "curate.near_dedup.bands=0"))
    check_data_config(cfg(f"data.corpus={corpus}", "curate.near_dedup.bands=0"))  # not curating: not used


def test_a_bad_weight_is_named_not_taken_for_a_path():
    with pytest.raises(UserError, match=r"^data.sources\[1\] = 'stdlib:x': the weight after ':' must be a number"):
        load_config(None, ["data.sources=stdlib:1,stdlib:x"])
