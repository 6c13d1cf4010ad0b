"""What data preparation prints: bars on a terminal, plain lines in a log, results always;
and curation after JAX has started does not fork JAX's threads."""

import io
import warnings

import pytest

from lm.config import load_config
from lm.data import progress
from lm.data.prepare import prepare_pretrain_data


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_bars_only_on_a_terminal():
    assert progress.bars(True, Terminal()) and not progress.lines(True, Terminal())
    assert not progress.bars(True, io.StringIO()) and progress.lines(True, io.StringIO())
    assert not progress.bars(False, Terminal()) and not progress.lines(False, io.StringIO())


def _config(corpus, workers):
    return load_config(
        "configs/tiny.py",
        [
            f"data.corpus={corpus}",
            "data.curate=true",
            f"data.workers={workers}",
            "data.heldout_fraction=0.3",
            "data.tokenizer=byte",
            "model.vocab_size=264",
            "curate.c4.enabled=false",
            "curate.fineweb.enabled=false",
            "curate.gopher_quality.enabled=false",
            "curate.language.threshold=0.2",
        ],
    )


@pytest.mark.parametrize("workers", [1, 2])
def test_a_log_gets_one_line_per_stage_and_no_escape_codes(tmp_path, corpus, capfd, workers):
    pytest.importorskip("datatrove")
    c = _config(corpus, workers)
    prepare_pretrain_data(c.data, tmp_path / "cache", progress=True, curate_cfg=c.curate)
    out, err = capfd.readouterr()  # file descriptors, as a redirected log sees them (worker processes too)
    assert "\x1b[" not in out + err
    assert "curate: pass 'filter' done in" in err and "curate: pass 'near_dedup: drop' done in" in err
    assert "tokenize: " in err and " done in " in err
    assert "stage" in out and "exact_dedup" in out  # the report table


def test_no_progress_still_prints_the_curation_report(tmp_path, corpus, capfd):
    pytest.importorskip("datatrove")
    c = _config(corpus, 1)
    prepare_pretrain_data(c.data, tmp_path / "cache", progress=False, curate_cfg=c.curate)
    out, err = capfd.readouterr()
    assert "stage" in out and "exact_dedup" in out and "in 12 docs" in out  # a result, not progress
    assert "done in" not in out + err


def test_curation_after_jax_started_does_not_fork_it(tmp_path, corpus):
    pytest.importorskip("datatrove")
    import jax

    jax.devices()  # starts the runtime, whose threads make os.fork unsafe (and installs the warning)

    from lm.data.curate import curate

    c = _config(corpus, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = curate(str(corpus), tmp_path / "out", c.curate, workers=2, progress=False, show_report=False)
    assert not [w for w in caught if "os.fork()" in str(w.message)]
    assert report["in"]["docs"] == 12 and report["kept"]["docs"] == 12
