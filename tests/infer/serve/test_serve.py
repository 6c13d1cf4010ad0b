"""`lm serve` through the official openai client: completions, chat, streaming, concurrent clients,
stop strings, refused requests, client disconnects, and a graceful stop on SIGTERM."""

import argparse
import json
import logging
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import jax
import numpy as np
import openai
import pytest
from safetensors.numpy import save_file

from lm.cli import main
from lm.config import base_config
from lm.data.tokenizer import ByteTokenizer
from lm.errors import UserError
from lm.infer.engine.engine import EngineConfig
from lm.infer.sampling import SamplingParams
from lm.infer.serve.app import make_app
from lm.infer.serve.backend import Delta
from lm.infer.serve.engine_backend import EngineBackend
from lm.infer.serve.metrics import Load
from lm.infer.serve.server import InThread
from lm.infer.session import Session
from lm.model.params import leaf_paths
from lm.model.spec import ModelSpec
from lm.model.transformer import Transformer
from lm.store.loaded import Loaded
from tests.model.test_transformer import random_params

GREEDY = dict(temperature=0)
# httpx waits 5 s by default: a loaded machine can take longer. A hang guard, never a speed limit.
WAIT = 600.0
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]  # one compiled shape


def tiny_config():
    c = base_config()
    c.model.update(
        vocab_size=264, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=128, init_std=0.3
    )
    c.data.update(tokenizer="byte", seq_len=128)
    return c


@pytest.fixture(scope="module")
def loaded():
    c = tiny_config()
    params = jax.tree.map(np.asarray, random_params(Transformer(ModelSpec.from_config(c.model)), seed=1))
    return Loaded(c, params, ByteTokenizer(), "tiny random model")


@pytest.fixture(scope="module")
def session(loaded):
    return Session(loaded)


@pytest.fixture(scope="module")
def server(session):
    backend = EngineBackend(session, "tiny", config=EngineConfig(slots=8, page_size=8))
    with InThread(make_app(backend)) as running:
        yield running
    backend.shutdown(cancel=True)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def expected(session, prompt: str, max_tokens: int, stop=()) -> dict:
    """What `Session.complete` gives (the server's worker is idle whenever a test calls this)."""
    return session.complete([prompt], SamplingParams(max_new_tokens=max_tokens, temperature=0), stop=stop)[0]


def sse(response) -> list:
    """The `data:` payloads of a server-sent-events response, [DONE] as the string."""
    events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


# ---- answers -----------------------------------------------------------------------------------


def test_plain_completion_is_session_completes_text(client, session):
    reply = client.completions.create(model="tiny", prompt="Hello", max_tokens=12, **GREEDY)
    want = expected(session, "Hello", 12)
    assert reply.choices[0].text == want["text"] and len(want["text"]) > 0
    assert reply.choices[0].finish_reason == "length" and reply.object == "text_completion"
    assert reply.id.startswith("cmpl-") and reply.model == "tiny"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (5, 12, 17)
    assert (
        client.completions.create(model="tiny", prompt=["Hello"], max_tokens=12, **GREEDY).choices[0].text
        == want["text"]
    )  # a list of one prompt is the prompt


def test_a_seed_draws_what_session_complete_draws_with_it(client, session):
    want = session.complete(["Hello"], SamplingParams(max_new_tokens=12, temperature=0.8, seed=7))[0]["text"]
    got = [
        client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0.8, seed=7).choices[0].text
        for _ in range(2)
    ]
    assert got == [want, want] and want != expected(session, "Hello", 12)["text"]


def test_chat_completion_is_session_chats_reply(client, session):
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, **GREEDY)
    want = session.chat([MESSAGES], SamplingParams(max_new_tokens=10, temperature=0))[0]
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want["text"]
    assert choice.finish_reason == {"eos": "stop"}.get(want["finish_reason"], want["finish_reason"])
    assert reply.object == "chat.completion" and reply.usage.completion_tokens == len(want["ids"])


def test_streamed_pieces_make_the_whole_text(client, server):
    whole = client.completions.create(model="tiny", prompt="def f(", max_tokens=20, **GREEDY).choices[0].text
    chunks = list(
        client.completions.create(
            model="tiny", prompt="def f(", max_tokens=20, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20  # the usage chunk
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 10, "stream": True, **GREEDY}
    reply = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=WAIT).json()
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=WAIT) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse(r)
    assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"]["role"] == "assistant"
    pieces = [e["choices"][0]["delta"].get("content") or "" for e in events[:-1]]
    assert "".join(pieces) == reply["choices"][0]["message"]["content"]
    assert events[-2]["choices"][0]["finish_reason"] == reply["choices"][0]["finish_reason"]


def test_sixteen_concurrent_clients_each_get_their_own_answer(client, session):
    prompts = [f"request {i:02d}" for i in range(16)]  # one length: one compiled prefill
    want = [expected(session, p, 8)["text"] for p in prompts]
    got = [None] * 16

    def ask(i):
        got[i] = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=8, **GREEDY).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == want and len(set(want)) > 1


def test_stop_strings_end_the_text_before_them_streamed_or_not(client, session):
    full = expected(session, "The quick", 16)["text"]
    i = next(
        i
        for i in range(1, len(full) - 1)
        if full[i : i + 2].isascii() and full[i : i + 2].isprintable() and full.find(full[i : i + 2]) == i
    )
    stop = [full[i : i + 2], "never in it"]
    reply = client.completions.create(model="tiny", prompt="The quick", max_tokens=16, stop=stop, **GREEDY)
    assert reply.choices[0].text == full[:i] and reply.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model="tiny", prompt="The quick", max_tokens=16, stop=stop, stream=True, **GREEDY
    )
    assert "".join(c.choices[0].text for c in streamed) == full[:i]


def test_the_backend_skips_a_cancelled_request_and_refuses_after_shutdown(session):
    backend = EngineBackend(session, "tiny", config=EngineConfig(slots=1, page_size=8))
    ids, _ = backend.prompt_ids(prompt="Hello")
    first = backend.submit(ids, SamplingParams(max_new_tokens=12, temperature=0), ())
    second = backend.submit(ids, SamplingParams(max_new_tokens=12, temperature=0), ())
    second.cancel()  # still waiting for the one slot
    deltas = list(first)
    assert "".join(d.text for d in deltas) == expected(session, "Hello", 12)["text"]
    assert sum(len(d.token_ids) for d in deltas) == 12 and deltas[-1].finish_reason == "length"
    assert [(d.text, d.finish_reason) for d in second] == [("", "cancelled")]
    backend.shutdown(cancel=False)
    with pytest.raises(UserError, match="shutting down"):
        backend.submit(ids, SamplingParams(max_new_tokens=2), ())


def test_a_json_schema_answer_always_parses_and_validates(client):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M", "L"]}},
        "required": ["ok", "size"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    for temperature in (0.0, 1.0, 1.5):
        reply = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=40, temperature=temperature, seed=1, response_format=fmt
        )
        answer = json.loads(reply.choices[0].message.content)
        assert set(answer) == {"ok", "size"} and isinstance(answer["ok"], bool) and answer["size"] in "SML"
        assert reply.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=40, temperature=0, stream=True, extra_body={"response_format": fmt}
    )  # an extension of /v1/completions, as vLLM's
    assert json.loads("".join(c.choices[0].text for c in streamed))["size"] in "SML"


def test_a_bad_response_format_is_a_400_with_its_reason(client):
    for fmt, words in (
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, "nonsense"),
        ({"type": "xml"}, "'response_format.type' is 'xml'"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, response_format=fmt)
        assert words in e.value.body["message"] and e.value.body["param"] == "response_format"


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health", timeout=WAIT).json() == {"status": "ok"}


def test_metrics_count_the_engines_tokens_and_prefix_hits(client, server):
    """Two chats sharing a long system prompt: the second takes its full pages from the cache."""
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict:
        text = httpx.get(server.url + "/metrics", timeout=WAIT).text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
        }

    before = scrape()
    system = {"role": "system", "content": "You answer in one short line. " * 2}
    for question in ("hi", "bye"):
        messages = [system, {"role": "user", "content": question}]
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, **GREEDY)
    after = scrape()
    grew = lambda name: after[(name, ())] - before.get((name, ()), 0.0)  # noqa: E731
    assert grew("lm_generation_tokens_total") == 6
    assert grew("lm_time_to_first_token_seconds_count") == 2 and grew("lm_request_latency_seconds_count") == 2
    assert grew("lm_prefix_cache_hit_tokens_total") >= 16  # the second chat took the system prompt's pages
    assert 0 < after[("lm_prefix_cache_hit_rate", ())] < 1
    assert after[("lm_requests_waiting", ())] == 0 and after[("lm_requests_running", ())] == 0


# ---- refused requests ---------------------------------------------------------------------------

OK = {"model": "tiny", "prompt": "x", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    "path, body, status, param, words",
    [
        ("completions", b"{not json", 400, None, "not valid JSON"),
        ("completions", b"[1, 2]", 400, None, "expected a JSON object"),
        ("completions", b"[" * 100_000, 400, None, "100000 levels deep; at most 64"),
        ("completions", {**OK, "model": "gpt-4"}, 404, "model", "'gpt-4' does not exist"),
        ("completions", {"prompt": "x"}, 400, "model", "missing required field 'model'"),
        ("completions", {**OK, "max_tokens": "5"}, 400, "max_tokens", "expected an integer"),
        ("completions", {**OK, "temperature": "hot"}, 400, "temperature", "expected a number"),
        ("completions", {**OK, "stream": "yes"}, 400, "stream", "expected a boolean"),
        (
            "completions",
            {**OK, "max_tokens": 200},
            400,
            "max_tokens",
            "1 tokens + max_tokens=200 exceed the model's context of 128",
        ),
        ("completions", {**OK, "prompt": "y" * 130}, 400, "prompt", "130 tokens"),
        ("completions", {**OK, "n": 2}, 400, "n", "'n' is 2"),
        ("completions", {**OK, "prompt": ""}, 400, "prompt", "empty"),
        ("completions", {**OK, "prompt": ["a", "b"]}, 400, "prompt", "array of one string"),
        ("completions", {**OK, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
        ("completions", {**OK, "top_p": 0}, 400, "top_p", "in (0, 1]"),
        ("completions", {**OK, "top_k": 2**40}, 400, "top_k", "0 to 2147483647"),
        ("completions", {**OK, "frobnicate": 1}, 400, "frobnicate", "unrecognized request field"),
        ("completions", {**OK, "logprobs": 3}, 400, "logprobs", "not supported"),
        ("chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages", "robot"),
        (
            "chat/completions",
            {**CHAT, "messages": [{"role": "assistant", "content": "hi"}]},
            400,
            "messages",
            "user turn",
        ),
        ("chat/completions", {"model": "tiny"}, 400, "messages", "missing required field 'messages'"),
    ],
)
def test_a_bad_request_gets_its_error_and_the_server_goes_on(server, client, path, body, status, param, words):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(
        f"{server.url}/v1/{path}", content=content, headers={"content-type": "application/json"}, timeout=WAIT
    )
    error = r.json()["error"]
    assert r.status_code == status and error["param"] == param and words in error["message"], error
    assert set(error) == {"message", "type", "param", "code"}
    assert [m.id for m in client.models.list().data] == ["tiny"]  # the next request is answered


def test_after_the_bad_requests_completions_go_on(client, session):
    assert (
        client.completions.create(model="tiny", prompt="Hello", max_tokens=12, **GREEDY).choices[0].text
        == expected(session, "Hello", 12)["text"]
    )


def test_unknown_paths_get_an_openai_error(server):
    r = httpx.get(server.url + "/v1/engines", timeout=WAIT)
    assert r.status_code == 404 and "Not Found" in r.json()["error"]["message"]


# ---- disconnects and stopping (a scripted backend: a slow, deterministic stream) -----------------


class Scripted:
    """Writes "x" every `delay` seconds, max_tokens times; records the streams it saw cancelled."""

    model_name, context = "scripted", 512

    def __init__(self, delay: float = 0.05):
        self.delay, self.cancelled, self.shut = delay, [], []
        self.waiting = 0  # what load() reports as waiting (the tests of the queue limit set it)

    def load(self):
        return Load(waiting=self.waiting, running=0)

    def prompt_ids(self, prompt=None, messages=None):
        return list((prompt or "chat").encode()), ()

    def submit(self, prompt_ids, sampling, stop, grammar=None):
        return SlowStream(self, sampling.max_new_tokens, len(prompt_ids))

    def shutdown(self, cancel):
        self.shut.append(cancel)


class SlowStream:
    def __init__(self, owner: Scripted, n: int, prompt_tokens: int):
        self.owner, self.n, self.prompt_tokens, self.stopped = owner, n, prompt_tokens, threading.Event()

    def __iter__(self):
        for i in range(self.n):
            if self.stopped.wait(self.owner.delay):
                yield Delta("", [], "cancelled")
                return
            yield Delta("x", [120], "length" if i == self.n - 1 else None)

    def cancel(self):
        self.owner.cancelled.append(self)
        self.stopped.set()


def wait_for(condition, seconds: float = 120.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_a_client_that_leaves_cancels_its_request():
    backend = Scripted()
    with InThread(make_app(backend)) as running:
        body = {"model": "scripted", "prompt": "p", "max_tokens": 200, "stream": True}
        with httpx.stream("POST", running.url + "/v1/completions", json=body, timeout=WAIT) as r:
            next(r.iter_lines())  # the first chunk arrived: the request runs; now leave
        assert wait_for(lambda: len(backend.cancelled) == 1), "a stream's client left: not cancelled"
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(running.url + "/v1/completions", json={**body, "stream": False}, timeout=0.3)
        assert wait_for(lambda: len(backend.cancelled) == 2), "a plain request's client left: not cancelled"
        r = httpx.post(running.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 3}, timeout=WAIT)
        assert r.json()["choices"][0]["text"] == "xxx" and len(backend.cancelled) == 2


@pytest.fixture(scope="module")
def export(tmp_path_factory, loaded):
    """The tiny model as an `lm export` .safetensors file."""
    path = tmp_path_factory.mktemp("export") / "tiny.safetensors"
    flat = {p: np.asarray(x) for p, x in zip(leaf_paths(loaded.params), jax.tree.leaves(loaded.params))}
    save_file(flat, str(path), metadata={"lm_config": loaded.config.to_json(), "lm_step": "0"})
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_until_sigterm(args: list[str], client_work) -> tuple[int, dict]:
    """Runs `lm serve ARGS` in this (the main) thread; a client thread waits for it, does
    `client_work(url, seen)`, which sends SIGTERM when it wants. -> (exit code, seen)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    port, seen, returned = free_port(), {}, threading.Event()
    url = f"http://127.0.0.1:{port}"

    def client():
        up = False
        try:
            up = wait_for(lambda: returned.is_set() or _healthy(url), WAIT) and not returned.is_set()
            assert up, "the server did not come up"
            client_work(url, seen)
        except BaseException as e:  # noqa: BLE001 (reported by the test)
            seen["error"] = e
        finally:
            if up and not seen.get("signalled"):  # never once `lm serve` has returned: it would end pytest
                os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    try:
        code = main(["serve", *args, "--port", str(port)])
    finally:
        returned.set()
    thread.join(30)
    if "error" in seen:
        raise seen["error"]
    return code, seen


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_lm_serve_answers_and_sigterm_exits_0(export, session, capsys):
    def work(url, seen):
        reply = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0).completions.create(
            model="tiny", prompt="Hello", max_tokens=12, **GREEDY
        )
        seen["text"] = reply.choices[0].text

    code, seen = serve_until_sigterm(["--params", str(export), "--model-name", "tiny"], work)
    out = capsys.readouterr()
    assert code == 0 and seen["text"] == expected(session, "Hello", 12)["text"]
    assert "lm serve: tiny at http://127.0.0.1:" in out.out and "stopped by SIGTERM" in out.err


@pytest.mark.parametrize("grace, finished", [(10.0, True), (0.2, False)])
def test_sigterm_lets_running_requests_finish_within_the_grace(export, monkeypatch, capfd, caplog, grace, finished):
    backend = Scripted(delay=0.02)
    monkeypatch.setattr("lm.infer.serve.engine_backend.make_backend", lambda loaded, args: backend)

    def work(url, seen):
        body = {"model": "scripted", "prompt": "p", "max_tokens": 50, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=WAIT) as r:
            lines = r.iter_lines()
            next(lines)
            seen["signalled"] = True
            os.kill(os.getpid(), signal.SIGTERM)  # mid-stream: 50 tokens take 1 s
            seen["events"] = [line for line in lines if line.startswith("data: ")]

    code, seen = serve_until_sigterm(["--params", str(export), "--grace", str(grace)], work)
    err, said = capfd.readouterr().err, [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert code == 0 and backend.shut == [True] and seen["events"][-1] == "data: [DONE]" and "Traceback" not in err
    assert not [r for r in caplog.records if r.exc_info]
    if finished:
        assert backend.cancelled == [] and said == []
        texts = [json.loads(e[6:])["choices"][0]["text"] for e in seen["events"][:-1]]
        assert "".join(texts) == "x" * 49  # the first chunk was read before the signal
    else:  # the grace ran out: the stream ends with the error event, then [DONE]
        assert (
            len(backend.cancelled) == 1
            and json.loads(seen["events"][-2][6:])["error"]["code"] == "server_shutting_down"
        )
        assert said == ["lm serve: grace period over, 1 request aborted"]


# ---- the verb ------------------------------------------------------------------------------------


def test_a_missing_extra_and_bad_flags_are_one_line_errors(export, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fastapi", None)
    assert main(["serve", "--params", str(export)]) == 2
    assert "pip install 'lm[serve]'" in capsys.readouterr().err
    monkeypatch.delitem(sys.modules, "fastapi")
    assert main(["serve", "--params", str(export), "--port", "0", "--slots", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lm: error: --slots 0: expected at least 1") and "\n" not in err
    assert main(["serve", "--params", str(export), "--port", "0", "--max-body-mib", "0"]) == 2
    assert capsys.readouterr().err.strip() == "lm: error: --max-body-mib 0: expected a size > 0"
    assert main(["serve", "--params", str(export), "--port", "0", "--max-waiting", "0"]) == 2
    assert capsys.readouterr().err.strip() == "lm: error: --max-waiting 0: expected at least 1"
    assert main(["serve", "--params", str(export), "--port", "0", "--api-key", " "]) == 2
    assert "--api-key (or $LM_API_KEY) is empty" in capsys.readouterr().err


def test_the_served_engine_takes_quantized_weights_int8_pages_and_speculation(export):
    from lm.infer.serve.engine_backend import make_backend
    from lm.model.qtensor import QTensor
    from lm.store.load import load_trained

    args = argparse.Namespace(
        quantize="int8", kv_cache="int8", speculate=2, slots=2, page_size=8, max_model_len=None, model_name="tiny"
    )
    backend = make_backend(load_trained(params=str(export)), args)
    try:
        engine = backend.service.engine
        leaves = jax.tree.leaves(backend.service.params, is_leaf=lambda x: isinstance(x, QTensor))
        assert any(isinstance(x, QTensor) for x in leaves) and engine.paging.kv == "int8"
        assert engine.config.speculate == 2
        ids, _ = backend.prompt_ids(prompt="Hello")
        deltas = list(backend.submit(ids, SamplingParams(max_new_tokens=4, temperature=0), ()))
        assert sum(len(d.token_ids) for d in deltas) == 4 and deltas[-1].finish_reason == "length"
    finally:
        backend.shutdown(cancel=True)


def test_the_parser_imports_neither_jax_nor_the_server():
    code = (
        "import sys; from lm.cli import _parser; _parser(); "
        "assert not {'jax', 'fastapi', 'uvicorn'} & set(sys.modules), 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=pathlib.Path(__file__).resolve().parents[3])
