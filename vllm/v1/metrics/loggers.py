"""The engine's Prometheus metrics, under vLLM's names.

``PrometheusStatLogger`` owns its own ``CollectorRegistry`` (two engines in
one process, as in tests, never collide on the global one); ``/metrics``
renders it with :meth:`render`. Every metric carries the ``model_name``
label as vLLM's do. The engine loop is the only writer: it reports the
scheduler's state after every step and each request's first token, later
tokens and end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

if TYPE_CHECKING:
    from vllm.v1.engine.core import SchedulerStats

# vLLM's buckets: latencies from milliseconds (a decode step on a GPU) to
# minutes (a long request on a CPU).
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort")


class PrometheusStatLogger:
    def __init__(self, model_name: str) -> None:
        disable_created_metrics()  # no *_created series, as vLLM
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        reg = self.registry
        self._running = Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            labels,
            registry=reg,
        ).labels(model_name)
        self._waiting = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            labels,
            registry=reg,
        ).labels(model_name)
        self._kv_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            labels,
            registry=reg,
        ).labels(model_name)
        self._prefix_cache_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            labels,
            registry=reg,
        ).labels(model_name)
        self._prefix_cache_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            labels,
            registry=reg,
        ).labels(model_name)
        self._prefix_cache_seen = (0, 0)  # the engine's totals so far
        self._prompt_tokens = Counter(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            labels,
            registry=reg,
        ).labels(model_name)
        self._generation_tokens = Counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            labels,
            registry=reg,
        ).labels(model_name)
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=reg,
        )
        self._success = {r: success.labels(model_name, r) for r in FINISH_REASONS}
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self._itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            labels,
            buckets=_ITL_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=reg,
        ).labels(model_name)

    def record_scheduler(self, stats: SchedulerStats) -> None:
        self._running.set(stats.num_running_reqs)
        self._waiting.set(stats.num_waiting_reqs)
        self._kv_usage.set(stats.kv_cache_usage)
        queries, hits = self._prefix_cache_seen  # the engine counts from its start
        self._prefix_cache_queries.inc(stats.prefix_cache_queries - queries)
        self._prefix_cache_hits.inc(stats.prefix_cache_hits - hits)
        self._prefix_cache_seen = (stats.prefix_cache_queries, stats.prefix_cache_hits)

    def record_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        self._ttft.observe(ttft_s)
        self._prompt_tokens.inc(num_prompt_tokens)
        self._generation_tokens.inc()

    def record_next_tokens(self, num_tokens: int, latency_s: float) -> None:
        """``num_tokens`` more tokens of one request, ``latency_s`` after its
        previous ones (each counts as one inter-token interval)."""
        self._generation_tokens.inc(num_tokens)
        for _ in range(num_tokens):
            self._itl.observe(latency_s / num_tokens)

    def record_finished(self, e2e_s: float, finish_reason: str) -> None:
        self._e2e.observe(e2e_s)
        self._success[finish_reason].inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
