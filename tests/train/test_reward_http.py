"""Rewards from an HTTP endpoint against a local threaded server (no network): one POST per
batch with the prompts, completions and columns; retries after a 503 and after a timeout;
failures reported, never a 0; 4xx and malformed answers as one-line errors naming the URL;
null rows; the config keys' checks; the docs' example server."""

import json
import pathlib
import re
from http.server import ThreadingHTTPServer
from threading import Thread

import numpy as np
import pytest

from lm.config import base_config
from lm.config.rl import check_rewards
from lm.errors import UserError
from lm.train.reward_failures import RewardFailures
from lm.train.reward_http import HttpReward, retry_after
from lm.train.rewards import RewardFn, Rewards
from tests.train.rewards_server import Reply, RewardServer

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROMPTS = ["sort 31", [{"role": "user", "content": "sort 2"}], "sort 7"]
COMPLETIONS = ["13", "2", "x7"]
COLUMNS = {"answer": ["13", "2", "7"], "level": [1, 2, 3]}


def endpoint(server, **kw) -> HttpReward:
    return HttpReward(server.url, **({"timeout": 60.0, "retries": 3, "backoff": 0.01} | kw))


def test_one_post_per_batch_carries_prompts_completions_and_columns():
    with RewardServer(Reply(body=lambda b: {"rewards": [float(len(c)) for c in b["completions"]]})) as server:
        out = endpoint(server)(PROMPTS, COMPLETIONS, **COLUMNS)
    assert out == [2.0, 1.0, 2.0]
    assert server.requests == [{"prompts": PROMPTS, "completions": COMPLETIONS, "columns": COLUMNS}]


def test_numpy_columns_travel_as_json():
    with RewardServer(Reply(body=lambda b: {"rewards": [1.0] * len(b["completions"])})) as server:
        endpoint(server)(["p"], ["c"], level=[np.int64(3)], vec=[np.arange(2)])
    assert server.requests[0]["columns"] == {"level": [3], "vec": [[0, 1]]}


def test_a_503_is_retried_then_the_answer_counts():
    ok = Reply(body=lambda b: {"rewards": [0.5] * len(b["completions"])})
    with RewardServer(Reply(503, b"busy"), Reply(502, b""), ok) as server:
        reward = endpoint(server)
        assert reward(PROMPTS, COMPLETIONS) == [0.5, 0.5, 0.5]
    assert len(server.requests) == 3 and reward.last_error == ""


def test_a_429_waits_the_seconds_its_retry_after_asks_and_the_key_goes_as_a_bearer_token(monkeypatch):
    slept = []
    monkeypatch.setattr("lm.train.reward_http.time.sleep", slept.append)
    monkeypatch.setenv("LM_REWARD_API_KEY", "k-123")
    ok = Reply(body=lambda b: {"rewards": [1.0] * len(b["completions"])})
    with RewardServer(Reply(429, b"slow down", headers={"Retry-After": "7"}), Reply(503, b""), ok) as server:
        assert endpoint(server, backoff=0.25)(PROMPTS, COMPLETIONS) == [1.0, 1.0, 1.0]
    assert slept == [7.0, 0.5]  # the asked 7 s, then the backoff's second wait (no Retry-After)
    assert [h.get("Authorization") for h in server.headers] == ["Bearer k-123"] * 3
    monkeypatch.delenv("LM_REWARD_API_KEY")
    with RewardServer(ok) as server:
        endpoint(server)(PROMPTS, COMPLETIONS)
    assert "Authorization" not in server.headers[0]


@pytest.mark.parametrize(
    "value, seconds", [("3", 3.0), ("0.5", 0.5), ("Wed, 21 Oct 2026 07:28:00 GMT", None), ("-1", None)]
)
def test_retry_after_in_seconds_only(value, seconds):
    assert retry_after(value) == seconds


def test_a_timeout_is_retried_then_the_batch_fails_with_its_reason():
    with RewardServer(Reply(hang=True)) as server:  # hangs until the server closes: far past the timeout
        reward = endpoint(server, timeout=0.5, retries=1)
        assert reward(PROMPTS, COMPLETIONS) == [None, None, None]  # failed, not 0
    assert reward.last_error == f"{server.url} failed after 2 tries: no answer within 0.5 s"


def test_an_endpoint_that_is_down_fails_after_its_retries():
    with RewardServer() as server:
        url = server.url
    reward = HttpReward(url, timeout=60.0, retries=2, backoff=0.01)  # the server is closed: refused
    assert reward(PROMPTS, COMPLETIONS) == [None] * 3
    assert reward.last_error.startswith(f"{url} failed after 3 tries: cannot connect (")


@pytest.mark.parametrize(
    "reply, message",
    [
        (
            Reply(400, b'{"error": "no answer column"}'),
            r'answered HTTP 400 Bad Request: \{"error": "no answer column"\}',
        ),
        (Reply(404, b""), "answered HTTP 404 Not Found; expected 200"),
        (Reply(body=b"<html>oops</html>"), "answered something that is not JSON .*: <html>oops</html>"),
        (Reply(body=b'{"scores": [1, 2, 3]}'), "answered JSON without a 'rewards' key"),
        (Reply(body=b'{"rewards": 1.0}'), "answered 'rewards' of type float"),
        (Reply(body=b'{"rewards": [1.0, 2.0]}'), "answered 2 rewards for 3 completions"),
        (Reply(body=b'{"rewards": [1.0, "high", 0]}'), 'answered "high" for completion 1'),
        (Reply(body=b'{"rewards": [1.0, true, 0]}'), "answered true for completion 1"),
        (Reply(body=b'{"rewards": [1.0, NaN, 0]}'), "answered something that is not JSON .*NaN"),
    ],
)
def test_a_4xx_or_a_malformed_answer_is_one_line_naming_the_url(reply, message):
    with RewardServer(reply) as server:
        with pytest.raises(UserError, match=f"^rl.reward_url: {re.escape(server.url)} {message}") as e:
            endpoint(server)(PROMPTS, COMPLETIONS)
    assert "\n" not in str(e.value)
    assert len(server.requests) == 1  # a mistake, not retried


def http_source(server, weight=1.0, **kw) -> RewardFn:
    return RewardFn("http", endpoint(server, **kw), weight, server.url, external=True)


def ones(prompts, completions, **columns):
    return [1.0] * len(completions)


def test_null_rows_fail_and_leave_the_total_without_a_stand_in_zero():
    with RewardServer(Reply(body=b'{"rewards": [1.0, null, 0.25]}')) as server:
        rewards = Rewards([RewardFn("ones", ones, 2.0), http_source(server)])
        total, parts = rewards(PROMPTS, [[]] * 3, COMPLETIONS, np.zeros(3, bool), [{}] * 3)
        assert parts["ones"].tolist() == [1.0, 1.0, 1.0]
        np.testing.assert_array_equal(parts["http"], [1.0, np.nan, 0.25])
        np.testing.assert_array_equal(total, [3.0, np.nan, 2.25])
        assert rewards.failable == ["http"]
        assert rewards.errors == {"http": f"{server.url} returned null for 1 of 3 completions"}
        # weight 0: logged only, so its failures exclude no row
        total, parts = Rewards([RewardFn("ones", ones, 1.0), http_source(server, 0.0)])(
            PROMPTS, [[]] * 3, COMPLETIONS, np.zeros(3, bool), [{}] * 3
        )
        np.testing.assert_array_equal(total, [1.0, 1.0, 1.0])
        assert np.isnan(parts["http"][1])


def test_failures_are_counted_and_stop_the_run_past_the_share():
    failures = RewardFailures(max_share=0.25)
    parts = {"http": np.array([1.0, np.nan, 0.0, 1.0])}
    m = failures.record(np.array([1.0, np.nan, 0.0, 1.0]), parts, ["http"], {"http": "x returned null for 1 of 4"})
    assert m == {"reward_failed": 1.0, "reward_failed_share": 0.25, "reward/http/failed": 1.0}
    with pytest.raises(UserError) as e:
        failures.record(np.full(4, np.nan), {"http": np.full(4, np.nan)}, ["http"], {"http": "u failed after 4 tries"})
    assert str(e.value) == (
        "rl: the rewards of 4 of 4 rollouts failed this step (5 of 8, 62.5%, since the run started; "
        "rl.max_reward_failures=0.25): u failed after 4 tries"
    )
    with pytest.raises(UserError, match="rl.max_reward_failures=0"):
        RewardFailures(0.0).record(np.array([1.0, np.nan]), {}, [], {})


def test_the_endpoint_joins_from_the_config():
    with RewardServer() as server:
        r = base_config().rl
        r.update(reward_url=server.url, reward_weight=0.5, reward_timeout=30.0, reward_retries=0)
        rewards = Rewards.from_config(r)
        (http,) = rewards.functions
        assert (http.name, http.weight, http.fn.timeout, http.fn.retries) == ("http", 0.5, 30.0, 0)
        total, parts = rewards(["p"], [[]], ["12"], np.zeros(1, bool), [{}])
    assert parts["http"].tolist() == [1.0] and total.tolist() == [0.5]


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("reward_url", "localhost:8000", "expected an http:// or https:// URL"),
        ("reward_url", "ftp://host/x", "expected an http:// or https:// URL"),
        ("reward_url", "http://host:port/x", "expected an http:// or https:// URL"),
        ("reward_url", "http:///score", "expected an http:// or https:// URL"),
        ("reward_timeout", 0.0, "expected seconds > 0"),
        ("reward_retries", -1, "expected an integer >= 0"),
        ("max_reward_failures", 1.5, r"expected a share in \[0, 1\]"),
    ],
)
def test_bad_endpoint_keys_are_one_line_errors_naming_the_key(key, value, message):
    r = base_config().rl
    r[key] = value
    with pytest.raises(UserError, match=f"^config key 'rl.{key}' = .*{message}"):
        check_rewards(r)


def docs_server() -> str:
    """The example endpoint docs/rl.md shows (the python block after its marker)."""
    text = (ROOT / "docs" / "rl.md").read_text()
    return re.search(r"<!-- reward server -->\n```python\n(.*?)```", text, re.S).group(1)


def test_the_docs_example_server_answers_the_schema():
    namespace = {"__name__": "reward_server"}
    exec(docs_server(), namespace)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), namespace["Handler"])
    Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        reward = HttpReward(f"http://127.0.0.1:{httpd.server_address[1]}/", timeout=60.0)
        out = reward(["q1", "q2", "q3"], ["it is 13", "<answer>2</answer>", "no idea"], answer=["13", "3", None])
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert out == [1.0, 0.0, None]
    assert json.loads(json.dumps({"rewards": out})) == {"rewards": [1.0, 0.0, None]}
