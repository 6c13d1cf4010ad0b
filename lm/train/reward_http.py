"""Rewards from an HTTP endpoint (`rl.reward_url`): one POST per rollout batch.

Request (JSON, `Content-Type: application/json`), the information a reward function gets:

    {"prompts": [...], "completions": ["...", ...], "columns": {"answer": [...], ...}}

Response: `{"rewards": [float | null, ...]}`, one entry per completion, in order. A `null` says
that this row's reward failed (the row is left out of the update, lm.train.rewards).

With the environment variable LM_REWARD_API_KEY set, each request carries `Authorization: Bearer
<its value>` (a key kept out of configs, which runs save).

Connection errors, timeouts, 5xx and 429 are retried `retries` times with exponential backoff
(or after the seconds of the answer's `Retry-After`, up to MAX_BACKOFF_S); when they persist
the whole batch's rewards fail (every row null) and the reason is kept. Any other 4xx, or a
response that is not the JSON above, is a UserError naming the URL and what was wrong: those are
mistakes that retrying does not mend.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import time
import urllib.error
import urllib.parse
import urllib.request

import numpy as np

from lm.errors import UserError

RETRIED_STATUS = (429,)  # besides 5xx: rate limits pass
MAX_BACKOFF_S = 30.0


def check_url(url: str, key: str = "rl.reward_url") -> str:
    """The URL, or a UserError when it is not http(s)://host[...]."""
    if not valid_url(url):
        raise UserError(f"config key '{key}' = {url!r}: expected an http:// or https:// URL")
    return url


def valid_url(url: str) -> bool:
    """http(s)://host[:port][/path]."""
    parts = urllib.parse.urlsplit(url)
    try:
        port_ok = parts.port != 0  # raises on a port that is not a number
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and port_ok


API_KEY_ENV = "LM_REWARD_API_KEY"


class RetriableError(Exception):
    """A failure worth another try (connection, timeout, 5xx, 429); `after`: the seconds the
    endpoint asked to wait (Retry-After), else None."""

    def __init__(self, message: str, after: float | None = None):
        super().__init__(message)
        self.after = after


class HttpReward:
    """TRL's signature over an endpoint: `reward(prompts, completions, **columns)` -> a list of
    floats with None where the row failed. `last_error` says why the last failed rows failed."""

    def __init__(self, url: str, timeout: float = 60.0, retries: int = 3, backoff: float = 1.0):
        self.url, self.timeout, self.retries, self.backoff = check_url(url), timeout, retries, backoff
        self.last_error = ""

    def __call__(self, prompts: list, completions: list[str], **columns) -> list[float | None]:
        body = self._body(prompts, completions, columns)
        reasons, after = [], None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.backoff * 2 ** (attempt - 1) if after is None else after, MAX_BACKOFF_S))
            try:
                out = self._parse(self._post(body), len(completions))
            except RetriableError as e:
                reasons.append(str(e))
                after = e.after
                continue
            failed = sum(v is None for v in out)
            self.last_error = f"{self.url} returned null for {failed} of {len(out)} completions" if failed else ""
            return out
        tries = f"{self.retries + 1} tr{'y' if self.retries == 0 else 'ies'}"
        self.last_error = f"{self.url} failed after {tries}: {'; '.join(dict.fromkeys(reasons))}"
        return [None] * len(completions)

    def _body(self, prompts: list, completions: list[str], columns: dict) -> bytes:
        request = {"prompts": list(prompts), "completions": list(completions), "columns": columns}
        try:
            return json.dumps(request, default=_jsonable).encode()
        except (TypeError, ValueError) as e:
            raise UserError(f"rl.reward_url: cannot send the rollouts to {self.url} as JSON: {e}") from None

    def _post(self, body: bytes) -> bytes:
        headers = {"Content-Type": "application/json"}
        if os.environ.get(API_KEY_ENV):
            headers["Authorization"] = f"Bearer {os.environ[API_KEY_ENV]}"
        request = urllib.request.Request(self.url, data=body, method="POST", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return response.read()
        except urllib.error.HTTPError as e:
            if e.code >= 500 or e.code in RETRIED_STATUS:
                raise RetriableError(f"HTTP {e.code} {e.reason}", retry_after(e.headers.get("Retry-After"))) from None
            detail = _snippet(e.read())
            raise UserError(
                f"rl.reward_url: {self.url} answered HTTP {e.code} {e.reason}"
                + (f": {detail}" if detail else "")
                + '; expected 200 with {"rewards": [...]}'
            ) from None
        except TimeoutError:  # socket.timeout is TimeoutError
            raise RetriableError(f"no answer within {self.timeout:g} s") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                raise RetriableError(f"no answer within {self.timeout:g} s") from None
            raise RetriableError(f"cannot connect ({e.reason})") from None
        except (ConnectionError, http.client.HTTPException) as e:
            raise RetriableError(f"connection failed ({type(e).__name__}: {e})") from None

    def _parse(self, raw: bytes, n: int) -> list[float | None]:
        """The response's rewards, or a UserError naming the URL and what is wrong with it."""

        def bad(what: str) -> UserError:
            return UserError(f'rl.reward_url: {self.url} answered {what}; expected {{"rewards": [float | null] x {n}}}')

        try:
            data = json.loads(raw, parse_constant=_no_constant)
        except ValueError as e:
            raise bad(f"something that is not JSON ({e}): {_snippet(raw)}") from None
        if not isinstance(data, dict) or "rewards" not in data:
            raise bad(f"JSON without a 'rewards' key: {_snippet(raw)}")
        rewards = data["rewards"]
        if not isinstance(rewards, list):
            raise bad(f"'rewards' of type {type(rewards).__name__}")
        if len(rewards) != n:
            raise bad(f"{len(rewards)} rewards for {n} completions")
        for i, v in enumerate(rewards):
            ok = v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))
            if not ok:
                raise bad(f"{_snippet(json.dumps(v).encode())} for completion {i}")
        return [None if v is None else float(v) for v in rewards]


def retry_after(value: str | None) -> float | None:
    """The seconds of a Retry-After header given in seconds (an HTTP date is not followed), else None."""
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and math.isfinite(seconds) and seconds >= 0 else None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _jsonable(value):
    """numpy values (from Parquet or Arrow prompt files) as plain JSON."""
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    raise TypeError(f"a prompt column holds {type(value).__name__}, which JSON cannot carry")


def _snippet(raw: bytes, limit: int = 120) -> str:
    text = " ".join(raw.decode("utf-8", "replace").split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
