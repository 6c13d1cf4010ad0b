"""`/metrics`: the server's load and latencies in Prometheus's text format (prometheus_client, one
registry per app). Gauges read the backend when scraped (requests waiting and running, the prefix
cache's hit rate); counters add up tokens and requests (Prometheus's `rate()` makes them tokens/s);
histograms hold each request's time to its first token, the time per token after it (a block of
tokens arriving together shares the gap before it) and its whole latency."""

from __future__ import annotations

import dataclasses
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

CONTENT_TYPE = CONTENT_TYPE_LATEST
SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
PER_TOKEN = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclasses.dataclass(frozen=True)
class Load:
    """What a backend reports when asked (`Backend.load`)."""

    waiting: int  # requests queued for a slot
    running: int  # requests generating
    prefix_hit_rate: float = 0.0  # prompt tokens taken from the prefix cache / prompt tokens, since start
    prefix_hit_tokens: int = 0  # prompt tokens taken from the prefix cache, since start


class Metrics:
    def __init__(self, load):
        r = self.registry = CollectorRegistry()
        Gauge("lm_requests_waiting", "Requests queued for a slot", registry=r).set_function(lambda: load().waiting)
        Gauge("lm_requests_running", "Requests generating", registry=r).set_function(lambda: load().running)
        Gauge(
            "lm_prefix_cache_hit_rate", "Share of prompt tokens taken from the prefix cache since start", registry=r
        ).set_function(lambda: load().prefix_hit_rate)
        r.register(_HitTokens(load))
        self.prompt_tokens = Counter("lm_prompt_tokens", "Prompt tokens of the requests taken", registry=r)
        self.generation_tokens = Counter("lm_generation_tokens", "Tokens generated", registry=r)
        self.ended = Counter("lm_requests_ended", "Requests ended, by finish reason", ["finish_reason"], registry=r)
        self.refused = Counter("lm_requests_refused", "Requests refused, by HTTP status", ["status"], registry=r)
        self.first_token = Histogram(
            "lm_time_to_first_token_seconds", "From a request's arrival to its first token", buckets=SECONDS, registry=r
        )
        self.per_token = Histogram(
            "lm_inter_token_latency_seconds",
            "Between a request's tokens after the first",
            buckets=PER_TOKEN,
            registry=r,
        )
        self.latency = Histogram(
            "lm_request_latency_seconds", "From a request's arrival to its end", buckets=SECONDS, registry=r
        )

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _HitTokens:
    """The prefix cache's hit tokens as a counter read from the backend when scraped."""

    def __init__(self, load):
        self.load = load

    def collect(self):
        family = CounterMetricFamily("lm_prefix_cache_hit_tokens", "Prompt tokens taken from the prefix cache")
        family.add_metric([], self.load().prefix_hit_tokens)
        yield family


class Tracker:
    """One request's timings, fed with its Deltas as they reach the client."""

    def __init__(self, metrics: Metrics, prompt_tokens: int, arrived: float):
        self.m, self.start, self.last, self.tokens = metrics, arrived, arrived, 0
        self.finish: str | None = None
        metrics.prompt_tokens.inc(prompt_tokens)

    def delta(self, token_ids, finish_reason) -> None:
        now = time.perf_counter()
        n = len(token_ids)
        if n:
            if not self.tokens:
                self.m.first_token.observe(now - self.start)
            else:
                for _ in range(n):
                    self.m.per_token.observe((now - self.last) / n)
            self.tokens += n
            self.last = now
            self.m.generation_tokens.inc(n)
        if finish_reason is not None:
            self.end(finish_reason)

    def end(self, finish_reason: str) -> None:
        """The request's end (once; later calls are ignored)."""
        if self.finish is None:
            self.finish = finish_reason
            self.m.ended.labels(finish_reason).inc()
            self.m.latency.observe(time.perf_counter() - self.start)
