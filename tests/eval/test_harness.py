"""lm-evaluation-harness through the adapter, offline, on local YAML tasks over a local JSON file:
the requests it sends are the ones its task definitions call for, and its numbers equal the
scoring core's (Scorer.score, completions) on the same examples."""

import argparse
import json
import math
import re

import numpy as np
import pytest

ROWS = [
    {
        "q": "def add(a, b):",
        "choices": ["return a + b", "print(hello)"],
        "label": 0,
        "text": "import os\nprint(os.getcwd())\n",
    },
    {"q": "import", "choices": ["os", "zzqx"], "label": 1, "text": "def f(x):\n    return x * 2\n"},
    {
        "q": "class Foo",
        "choices": ["(object):", "$$$", "Bar:"],
        "label": 0,
        "text": "for i in range(300):\n    total = total + i * i  # a sum of squares\n" * 7,
    },  # > 256 bytes
    {"q": "for i in", "choices": ["range(10):", "x y z", "[]:", "in"], "label": 0, "text": "x = [1, 2, 3]\n"},
]

TASKS = {
    "mc": "output_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: label\n"
    "metric_list:\n  - metric: acc\n  - metric: acc_norm\n",
    "rolling": "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\nmetric_list:\n"
    "  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n",
    "gen": "output_type: generate_until\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{choices[0]}}'\n"
    'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 6\nmetric_list:\n  - metric: exact_match\n',
    "sample": "output_type: generate_until\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{choices[0]}}'\n"
    "generation_kwargs:\n  do_sample: true\n  temperature: 2.0\n  max_gen_toks: 8\n"
    "metric_list:\n  - metric: exact_match\n",
}


@pytest.fixture
def local_tasks(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("DISABLE_MULTIPROC", "1")  # what `lm harness` sets, undone after the test
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    for name, body in TASKS.items():
        (tmp_path / f"{name}.yaml").write_text(
            f"task: local_{name}\ndataset_path: json\ndataset_kwargs:\n  data_files: {data}\ntest_split: train\n{body}"
        )
    return tmp_path


def recording_model(small_base):
    """The adapter, keeping the arguments of every request it receives."""
    from lm.eval.harness import HarnessModel

    class Recording(HarnessModel):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.seen = {"loglikelihood": [], "loglikelihood_rolling": [], "generate_until": []}

        def loglikelihood(self, requests, disable_tqdm=False):
            self.seen["loglikelihood"] += [r.args for r in requests]
            return super().loglikelihood(requests, disable_tqdm)

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            self.seen["loglikelihood_rolling"] += [r.args for r in requests]
            return super().loglikelihood_rolling(requests, disable_tqdm)

        def generate_until(self, requests, disable_tqdm=False):
            self.seen["generate_until"] += [r.args for r in requests]
            return super().generate_until(requests, disable_tqdm)

    return Recording(workdir=str(small_base), batch_size=8)


def test_harness_numbers_equal_the_scoring_core(small_base, local_tasks):
    from lm.data.chat import ChatTemplate
    from lm.eval.complete import completions
    from lm.eval.harness import run_harness
    from lm.eval.loglik import encode_pair

    model = recording_model(small_base)
    got = run_harness(tasks=["local_mc", "local_rolling", "local_gen"], include_path=str(local_tasks), model=model)[
        "results"
    ]
    s, tok = model.scorer, model.tok

    # (a) multiple choice: context, then " " + choice (the target delimiter) per choice
    assert model.seen["loglikelihood"] == [(r["q"], " " + c) for r in ROWS for c in r["choices"]]
    preds, norms = [], []
    for r in ROWS:
        logp = np.array([x.logp for x in s.score([encode_pair(tok, r["q"], " " + c) for c in r["choices"]])])
        preds.append(int(np.argmax(logp)))
        norms.append(int(np.argmax(logp / np.array([len(c) for c in r["choices"]]))))  # per character of the choice
    labels = [r["label"] for r in ROWS]
    assert got["local_mc"]["acc,none"] == pytest.approx(np.mean(np.array(preds) == labels))
    assert got["local_mc"]["acc_norm,none"] == pytest.approx(np.mean(np.array(norms) == labels))
    assert got["local_mc"]["acc_stderr,none"] > 0  # closed form, no forked bootstrap

    # (b) rolling: every token after end-of-text; the long text in the harness's own windows
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    assert model.seen["loglikelihood_rolling"] == [(r["text"],) for r in ROWS]
    docs = [[int(t) for t in tok.encode(r["text"])] for r in ROWS]
    logps = [x.logp for x in s.rolling(docs, prefix=tok.eos_id)]
    windows = [make_disjoint_window(w) for w in get_rolling_token_windows(docs[2], tok.eos_id, s.max_len, 1)]
    assert len(windows) == 2
    logps[2] = sum(x.logp for x in s.score(windows))  # its last window sees the text before it
    n_bytes = sum(len(r["text"].encode()) for r in ROWS)
    n_words = sum(len(re.split(r"\s+", r["text"])) for r in ROWS)
    rolling = got["local_rolling"]
    assert rolling["bits_per_byte,none"] == pytest.approx(-sum(logps) / math.log(2) / n_bytes, rel=1e-6)
    assert rolling["byte_perplexity,none"] == pytest.approx(math.exp(-sum(logps) / n_bytes), rel=1e-6)
    assert rolling["word_perplexity,none"] == pytest.approx(math.exp(-sum(logps) / n_words), rel=1e-6)

    # (c) generation: the task's stop strings and length, greedy
    assert [a[0] for a in model.seen["generate_until"]] == [r["q"] for r in ROWS]
    assert all(a[1]["until"] == ["\n"] and a[1]["max_gen_toks"] == 6 for a in model.seen["generate_until"])
    ours = completions(
        s.model,
        s.params,
        tok,
        [tok.encode(r["q"]) for r in ROWS],
        max_new_tokens=6,
        stop=("\n",),
        mesh=s.mesh,
        rules=s.rules,
        batch_size=8,
    )
    predictions = [o["text"] for o in ours]
    assert all("\n" not in p for p in predictions)
    out = run_harness(tasks=["local_gen"], include_path=str(local_tasks), model=model, log_samples=True)
    samples = sorted(out["samples"]["local_gen"], key=lambda x: x["doc_id"])
    assert [x["resps"][0][0] for x in samples] == predictions
    exact = np.mean([p == r["choices"][0] for p, r in zip(predictions, ROWS)])
    assert out["results"]["local_gen"]["exact_match,none"] == pytest.approx(exact)
    # sampled at the task's temperature, as completions samples (same batches, same seed)
    out = run_harness(tasks=["local_sample"], include_path=str(local_tasks), model=model, log_samples=True)
    samples = sorted(out["samples"]["local_sample"], key=lambda x: x["doc_id"])
    ours = completions(
        s.model,
        s.params,
        tok,
        [tok.encode(r["q"]) for r in ROWS],
        max_new_tokens=8,
        temperature=2.0,
        mesh=s.mesh,
        rules=s.rules,
        batch_size=8,
    )
    assert [x["resps"][0][0] for x in samples] == [o["text"] for o in ours]
    assert len({o["text"] for o in ours}) > 1

    # chat: prompts in our template, scored and continued from its ids (role tokens included)
    model.seen["loglikelihood"].clear()
    chat = run_harness(
        tasks=["local_mc", "local_rolling"],
        include_path=str(local_tasks),
        model=model,
        apply_chat_template=True,
        log_samples=True,
    )
    # a task without a prompt renders no chat turn (its empty user turn is left out)
    assert chat["results"]["local_rolling"]["bits_per_byte,none"] == rolling["bits_per_byte,none"]
    template = ChatTemplate.for_tokenizer(tok)
    for r, x in zip(ROWS, sorted(chat["samples"]["local_mc"], key=lambda x: x["doc_id"])):
        prompt = [int(t) for t in template.prompt([{"role": "user", "content": r["q"]}])]
        context = tok.decode(prompt)
        assert model.rendered[context] == prompt
        assert [a for a in model.seen["loglikelihood"] if a[0] == context] == [(context, c) for c in r["choices"]]
        ours = s.score([(prompt, [int(t) for t in tok.encode(c)]) for c in r["choices"]])
        assert [resp[0][0] for resp in x["resps"]] == pytest.approx([o.logp for o in ours], rel=1e-6)


def test_harness_cli_and_errors(small_base, local_tasks, tmp_path, capsys):
    from lm.errors import UserError
    from lm.eval import harness_cli
    from lm.eval.harness import HarnessModel

    sub = argparse.ArgumentParser().add_subparsers(dest="verb")
    harness_cli.add_parser(sub)
    parse = sub.choices["harness"].parse_args
    out = tmp_path / "h.json"
    assert (
        harness_cli.run(
            parse(
                [
                    "--workdir",
                    str(small_base),
                    "--tasks",
                    "local_mc",
                    "--include-path",
                    str(local_tasks),
                    "--limit",
                    "2",
                    "--batch-size",
                    "8",
                    "--out",
                    str(out),
                ]
            )
        )
        == 0
    )
    table = capsys.readouterr().out
    assert "acc_norm" in table and "local_mc" in table
    assert json.loads(out.read_text())["results"]["local_mc"]["alias"] == "local_mc"
    with pytest.raises(UserError, match="unknown task.*no_such_task"):
        harness_cli.run(
            parse(["--workdir", str(small_base), "--tasks", "no_such_task", "--include-path", str(local_tasks)])
        )
    with pytest.raises(UserError, match="unknown model argument.*workdr"):
        HarnessModel(workdr=str(small_base))
    from lm_eval.api.registry import get_model

    assert get_model("lm") is HarnessModel  # simple_evaluate(model="lm", model_args="workdir=RUN")


def test_harness_equals_lm_eval_on_the_same_examples(small_base, local_tasks, tmp_path):
    from lm.cli import main
    from lm.eval.harness import run_harness

    model = recording_model(small_base)
    out = run_harness(tasks=["local_mc", "local_gen"], include_path=str(local_tasks), model=model, log_samples=True)
    (tmp_path / "mc.jsonl").write_text(
        "".join(json.dumps({"context": r["q"], "choices": r["choices"], "answer": r["label"]}) + "\n" for r in ROWS)
    )
    (tmp_path / "gen.jsonl").write_text(
        "".join(json.dumps({"prompt": r["q"], "answer": r["choices"][0]}) + "\n" for r in ROWS)
    )
    report = tmp_path / "r.json"
    assert (
        main(
            [
                "eval",
                "--workdir",
                str(small_base),
                "--batch-size",
                "8",
                "--no-progress",
                "--out",
                str(report),
                "--tasks",
                f"mc={tmp_path / 'mc.jsonl'}",
                f"gen={tmp_path / 'gen.jsonl'}?chat=false&max_new_tokens=6&scorer=exact",
            ]
        )
        == 0
    )
    ours = json.loads(report.read_text())["tasks"]
    assert out["results"]["local_mc"]["acc,none"] == pytest.approx(ours["mc"]["metrics"]["acc"])
    assert out["results"]["local_mc"]["acc_norm,none"] == pytest.approx(ours["mc"]["metrics"]["acc_norm"])
    harness_gen = [x["resps"][0][0] for x in sorted(out["samples"]["local_gen"], key=lambda x: x["doc_id"])]
    assert harness_gen == [x["prediction"] for x in ours["gen"]["samples"]]


def test_harness_task_without_its_dataset_is_one_line(local_tasks, tmp_path):
    """A task whose dataset cannot be loaded (offline, never cached; or a missing local file) is a
    UserError naming the task and its dataset, not the datasets library's traceback."""
    import types

    from lm.errors import UserError
    from lm.eval.harness import HarnessModel, run_harness

    model = HarnessModel(scorer=types.SimpleNamespace(tokenizer=None))  # never asked for a score
    body = TASKS["mc"]
    (local_tasks / "hub.yaml").write_text(
        f"task: local_hub\ndataset_path: no_such_org/no_such_set\ntest_split: test\n{body}"
    )
    (local_tasks / "gone.yaml").write_text(
        f"task: local_gone\ndataset_path: json\ndataset_kwargs:\n"
        f"  data_files: {tmp_path / 'gone.jsonl'}\ntest_split: train\n{body}"
    )
    with pytest.raises(
        UserError,
        match=r"task 'local_hub': its dataset 'no_such_org/no_such_set' could not be "
        r"loaded .*HF_DATASETS_OFFLINE.*--include-path",
    ) as e:
        run_harness(tasks=["local_hub"], include_path=str(local_tasks), model=model)
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match=r"task 'local_gone': its dataset 'json' could not be loaded .*gone\.jsonl"):
        run_harness(tasks=["local_gone"], include_path=str(local_tasks), model=model)
