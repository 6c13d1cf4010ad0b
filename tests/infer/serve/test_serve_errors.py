"""Every error `lm serve` returns is an OpenAI error object with a 4xx/5xx status: unknown routes and
methods, bad content types, bodies that are not JSON, too large or nested too deep, bugs, and the
requests still running when a stop's grace period ends (no traceback in the log for any of them)."""

import json
import logging
import socket
import threading

import httpx
import pytest

from lm.infer.serve.app import make_app
from lm.infer.serve.protocol import MAX_BODY, MAX_DEPTH, nesting
from lm.infer.serve.server import InThread
from tests.infer.serve.test_serve import WAIT, Scripted, wait_for

OK = {"model": "scripted", "prompt": "p", "max_tokens": 2}
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server():
    with InThread(make_app(Scripted(delay=0.001))) as running:
        yield running


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status and r.headers["content-type"] == "application/json", (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    return error


def still_serving(url: str) -> None:
    r = httpx.post(url + "/v1/completions", json=OK, timeout=WAIT)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "xx"


def test_a_body_nested_100000_levels_deep_gets_400_and_no_traceback(server, caplog, capfd):
    for body in (b"[" * 100_000, b'{"model": ' * 100_000, b"[" * 100_000 + b"]" * 100_000):
        error = error_of(httpx.post(server.url + "/v1/chat/completions", content=body, headers=JSON, timeout=WAIT), 400)
        assert "100000 levels deep" in error["message"] and f"at most {MAX_DEPTH}" in error["message"]
        assert error["code"] == "too_deeply_nested"
    still_serving(server.url)
    assert not [r for r in caplog.records if r.exc_info] and "Traceback" not in capfd.readouterr().err


def test_nesting_counts_brackets_outside_strings_only():
    assert nesting(b'{"a": [{"b": "x\\"[[{"}, "\\\\"]}') == 3 and nesting(b'"[[[') == 0 and nesting(b"") == 0
    assert nesting(b"[" * 10 + b"]" * 10 + b"[[") == 10 and nesting(b"[]" * 3_000_000) == 1


def test_a_body_over_the_limit_gets_413_unread(server):
    error = error_of(
        httpx.post(server.url + "/v1/completions", content=b" " * (MAX_BODY + 1), headers=JSON, timeout=WAIT), 413
    )
    assert error["code"] == "request_too_large" and f"at most {MAX_BODY} bytes" in error["message"]
    still_serving(server.url)


def test_a_chunked_body_over_the_limit_gets_413():
    with InThread(make_app(Scripted(delay=0.001), max_body=1000)) as running:
        chunks = iter([b"{" + b" " * 600, b" " * 600 + b"}"])  # no Content-Length: counted as it arrives
        error = error_of(httpx.post(running.url + "/v1/completions", content=chunks, headers=JSON, timeout=WAIT), 413)
        assert "at most 1000 bytes" in error["message"]
        still_serving(running.url)


@pytest.mark.parametrize(
    "method, path, headers, body, status, words",
    [
        ("GET", "/v1/completions", {}, None, 405, "Method Not Allowed"),
        ("DELETE", "/health", {}, None, 405, "Method Not Allowed"),
        ("POST", "/v1/models", JSON, b"{}", 405, "Method Not Allowed"),
        ("GET", "/v2/nowhere", {}, None, 404, "Not Found"),
        ("POST", "/v1/completions", {"content-type": "text/plain"}, json.dumps(OK).encode(), 415, "application/json"),
        ("POST", "/v1/completions", {"content-type": "application/x-www-form-urlencoded"}, b"a=1", 415, "-H"),
        ("POST", "/v1/completions", JSON, b"", 400, "not valid JSON"),
        ("POST", "/v1/completions", JSON, b"\xff\xfe\x00garbage", 400, "not valid JSON"),
        ("POST", "/v1/completions", JSON, b'{"model": "scripted", "seed": ' + b"9" * 5000 + b"}", 400, "digits"),
        ("POST", "/v1/chat/completions", JSON, b'{"a": ' * 65 + b"1" + b"}" * 65, 400, "65 levels deep"),
    ],
)
def test_every_refusal_is_an_error_object(server, method, path, headers, body, status, words):
    r = httpx.request(method, server.url + path, content=body, headers=headers, timeout=WAIT)
    assert words in error_of(r, status)["message"]
    if status == 405:
        assert r.headers["allow"]


def test_a_request_http_cannot_parse_gets_an_error_object(server):
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=WAIT) as s:
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        head, _, body = b"".join(iter(lambda: s.recv(65536), b"")).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    assert json.loads(body)["error"]["code"] == "bad_http"


def test_a_client_that_leaves_mid_body_leaves_no_trace(server, caplog, capfd):
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=WAIT) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"model": '
        )
    assert wait_for(lambda: not server.server.server_state.tasks)  # its request has ended
    still_serving(server.url)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING] and "Traceback" not in capfd.readouterr().err


class Broken(Scripted):
    def prompt_ids(self, prompt=None, messages=None):
        raise KeyError("a bug")


def test_a_bug_gets_a_json_500_and_the_server_goes_on(caplog):
    with InThread(make_app(Broken())) as running:
        error = error_of(
            httpx.post(running.url + "/v1/completions", json={**OK, "model": "scripted"}, timeout=WAIT), 500
        )
        assert "KeyError" in error["message"]
        assert httpx.get(running.url + "/health", timeout=WAIT).json() == {"status": "ok"}
    assert [r.getMessage() for r in caplog.records if r.name == "lm.serve"] == ["lm serve: POST /v1/completions failed"]


# ---- the end of the grace period ---------------------------------------------------------------------


def test_when_the_grace_ends_a_stream_gets_its_last_events_and_a_plain_request_a_503(caplog, capfd):
    backend = Scripted(delay=0.02)
    backend.context = 200_000  # 100,000 tokens: each request runs until aborted
    app = make_app(backend)
    running = InThread(app, grace=0.5)
    seen = {}

    def stream():
        body = {**OK, "max_tokens": 100_000, "stream": True}
        with httpx.stream("POST", running.url + "/v1/completions", json=body, timeout=WAIT) as r:
            seen["events"] = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]

    def plain():
        seen["plain"] = httpx.post(running.url + "/v1/completions", json={**OK, "max_tokens": 100_000}, timeout=WAIT)

    threads = [threading.Thread(target=f) for f in (stream, plain)]
    for t in threads:
        t.start()
    assert wait_for(lambda: len(app.state.inflight.inboxes) == 2), "the requests did not start"
    running.stop()
    for t in threads:
        t.join(WAIT)
    *text, last, done = seen["events"]
    assert done == "[DONE]" and json.loads(last)["error"]["code"] == "server_shutting_down"
    assert text and all(json.loads(e)["choices"][0]["text"] == "x" for e in text)  # what it had, then the end
    error = error_of(seen["plain"], 503)
    assert error["code"] == "server_shutting_down" and "grace period" in error["message"]
    assert len(backend.cancelled) == 2  # both generations stopped
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        "lm serve: grace period over, 2 requests aborted"
    ]
    assert not [r for r in caplog.records if r.exc_info] and "Traceback" not in capfd.readouterr().err
