"""`lm serve`'s limits and metrics on a scripted backend: the API key (401 without it, /health and
/metrics open), the queue limit (429 with Retry-After), and /metrics counting tokens, ends,
refusals and latencies as Prometheus reads them."""

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lm.infer.serve.app import make_app
from lm.infer.serve.server import InThread
from tests.infer.serve.test_serve import WAIT, Scripted

OK = {"model": "scripted", "prompt": "p", "max_tokens": 3}


def scrape(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=WAIT).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_an_api_key_guards_v1_only():
    with InThread(make_app(Scripted(delay=0.001), api_key="sesame")) as running:
        url = running.url
        for headers in ({}, {"authorization": "Bearer open"}, {"authorization": "sesame"}):
            r = httpx.post(url + "/v1/completions", json=OK, headers=headers, timeout=WAIT)
            error = r.json()["error"]
            assert r.status_code == 401 and error["code"] == "invalid_api_key" and "--api-key" in error["message"]
        assert httpx.get(url + "/v1/models", timeout=WAIT).status_code == 401
        assert httpx.get(url + "/health", timeout=WAIT).status_code == 200
        assert httpx.get(url + "/metrics", timeout=WAIT).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).completions.create(**OK)
        good = openai.OpenAI(base_url=url + "/v1", api_key="sesame", max_retries=0)
        assert good.completions.create(**OK).choices[0].text == "xxx"
        assert scrape(url)[("lm_requests_refused_total", (("status", "401"),))] == 5  # 3 posts, models, the client


def test_a_full_queue_gets_429_with_retry_after():
    backend = Scripted(delay=0.001)
    with InThread(make_app(backend, max_waiting=3)) as running:
        backend.waiting = 3
        r = httpx.post(running.url + "/v1/completions", json=OK, timeout=WAIT)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "rate_limit_exceeded" and "--max-waiting" in r.json()["error"]["message"]
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0).completions.create(**OK)
        backend.waiting = 2
        assert httpx.post(running.url + "/v1/completions", json=OK, timeout=WAIT).json()["choices"][0]["text"] == "xxx"
        assert scrape(running.url)[("lm_requests_waiting", ())] == 2


def test_metrics_count_tokens_ends_and_latencies():
    backend = Scripted(delay=0.001)
    with InThread(make_app(backend)) as running:
        url = running.url
        httpx.post(url + "/v1/completions", json=OK, timeout=WAIT)  # prompt "p": 1 token, 3 new tokens
        with httpx.stream(
            "POST", url + "/v1/completions", json={**OK, "stream": True, "max_tokens": 5}, timeout=WAIT
        ) as r:
            assert r.status_code == 200 and list(r.iter_lines())
        httpx.post(url + "/v1/completions", json={**OK, "model": "other"}, timeout=WAIT)  # 404
        got = scrape(url)
    assert got[("lm_prompt_tokens_total", ())] == 2 and got[("lm_generation_tokens_total", ())] == 8
    assert got[("lm_requests_ended_total", (("finish_reason", "length"),))] == 2
    assert got[("lm_requests_refused_total", (("status", "404"),))] == 1
    assert got[("lm_time_to_first_token_seconds_count", ())] == 2
    assert got[("lm_inter_token_latency_seconds_count", ())] == 8 - 2  # every token after a request's first
    assert got[("lm_request_latency_seconds_count", ())] == 2
    assert got[("lm_request_latency_seconds_sum", ())] >= got[("lm_time_to_first_token_seconds_sum", ())] > 0
