"""lm-evaluation-harness through the adapter, on local tasks over a local JSON file: its numbers
equal `lm eval`'s (multiple choice, generation) and the scoring core's (rolling log-likelihood)."""

import json
import math

import pytest

from lm.cli import main

ROWS = [{"q": "def add(a, b):", "choices": ["return a + b", "print(hello)"], "label": 0,
         "text": "import os\nprint(os.getcwd())\n"},
        {"q": "import", "choices": ["os", "zzqx"], "label": 1, "text": "def f(x):\n    return x * 2\n"},
        {"q": "class Foo", "choices": ["(object):", "$$$", "Bar:"], "label": 0, "text": "for i in range(3):\n    pass\n"},
        {"q": "for i in", "choices": ["range(10):", "x y z"], "label": 0, "text": "x = [1, 2, 3]\n"}]

TASKS = {
    "mc": "output_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: label\n"
          "metric_list:\n  - metric: acc\n  - metric: acc_norm\n",
    "rolling": "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
               "metric_list:\n  - metric: bits_per_byte\n",
    "gen": "output_type: generate_until\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{choices[0]}}'\n"
           "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 6\nmetric_list:\n  - metric: exact_match\n",
}


@pytest.fixture
def local_tasks(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    for name, body in TASKS.items():
        (tmp_path / f"{name}.yaml").write_text(f"task: local_{name}\ndataset_path: json\ndataset_kwargs:\n"
                                               f"  data_files: {data}\ntest_split: train\n{body}")
    return tmp_path


@pytest.mark.slow
def test_harness_numbers_equal_lm_eval(small_base, local_tasks, tmp_path):
    from lm.eval.harness import HarnessModel, run_harness

    model = HarnessModel(workdir=str(small_base), batch_size=8)
    out = run_harness(tasks=["local_mc", "local_rolling", "local_gen"], include_path=str(local_tasks), model=model,
                      log_samples=True)
    got = out["results"]
    # the same examples through `lm eval`: multiple choice and raw-prompt generation
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps({"context": r["q"], "choices": r["choices"],
                                                           "answer": r["label"]}) + "\n" for r in ROWS))
    (tmp_path / "gen.jsonl").write_text("".join(json.dumps({"prompt": r["q"], "answer": r["choices"][0]}) + "\n"
                                                for r in ROWS))
    report = tmp_path / "r.json"
    assert main(["eval", "--workdir", str(small_base), "--batch-size", "8", "--no-progress", "--out", str(report),
                 "--tasks", f"mc={tmp_path / 'mc.jsonl'}",
                 f"gen={tmp_path / 'gen.jsonl'}?chat=false&max_new_tokens=6"]) == 0
    ours = json.loads(report.read_text())["tasks"]
    assert got["local_mc"]["acc,none"] == pytest.approx(ours["mc"]["metrics"]["acc"])
    assert got["local_mc"]["acc_norm,none"] == pytest.approx(ours["mc"]["metrics"]["acc_norm"])
    assert ("loglikelihood", ("class Foo", " (object):")) in model.seen  # context, " " + choice
    predictions = [s["resps"][0][0] for s in sorted(out["samples"]["local_gen"], key=lambda s: s["doc_id"])]
    assert predictions == [s["prediction"] for s in ours["gen"]["samples"]]
    # rolling: every token after end-of-text, bits per byte over the UTF-8 bytes of the text
    scores = model.scorer.rolling([model.tok.encode(r["text"]) for r in ROWS], prefix=model.tok.eos_id)
    bpb = -sum(s.logp for s in scores) / math.log(2) / sum(len(r["text"].encode()) for r in ROWS)
    assert got["local_rolling"]["bits_per_byte,none"] == pytest.approx(bpb, rel=1e-6)
    # a chat prompt the harness renders is scored from the template's ids (role tokens included)
    from lm.data.chat import ChatTemplate

    chat = [{"role": "user", "content": "sort 9071"}]
    text = model.apply_chat_template(chat)
    assert model._context_ids(text) == [int(t) for t in ChatTemplate.for_tokenizer(model.tok).prompt(chat)]
    assert model._pair(text, "0179")[1] == [int(t) for t in model.tok.encode("0179")]


@pytest.mark.slow
def test_lm_harness_cli(small_base, local_tasks, tmp_path, capsys):
    out = tmp_path / "h.json"
    assert main(["harness", "--workdir", str(small_base), "--tasks", "local_mc", "--include-path",
                 str(local_tasks), "--offline", "--out", str(out)]) == 0
    assert "acc_norm" in capsys.readouterr().out and "local_mc" in json.loads(out.read_text())["results"]
    assert main(["harness", "--workdir", str(small_base), "--tasks", "no_such_task", "--include-path",
                 str(local_tasks)]) == 2
    assert "unknown task(s) no_such_task" in capsys.readouterr().err
