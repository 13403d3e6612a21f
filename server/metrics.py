"""Prometheus metrics, named as vLLM names them with the `pagoda:` prefix.

Each app owns a CollectorRegistry (tests build several apps in one process).
Gauges and the engine's cumulative counters are read at scrape time from the
stats snapshot the engine thread publishes after every step; latencies and
token counts are observed on the event loop as outputs arrive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.request import RequestOutput

# Latency buckets in seconds (vLLM's, trimmed).
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
_REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
)


class _EngineStatsCollector(Collector):
    """Reads the latest engine stats snapshot when /metrics is scraped."""

    def __init__(self, read_stats: Callable[[], Any], read_waiting: Callable[[], int]) -> None:
        self._read_stats = read_stats
        self._read_waiting = read_waiting

    def collect(self) -> Iterator[Metric]:
        stats = self._read_stats()

        def stat(name: str) -> float:
            return float(getattr(stats, name, 0) or 0) if stats is not None else 0.0

        yield GaugeMetricFamily(
            "pagoda:num_requests_running", "Requests in the running batch.", stat("num_running")
        )
        yield GaugeMetricFamily(
            "pagoda:num_requests_waiting",
            "Requests waiting to be scheduled.",
            float(self._read_waiting()),
        )
        yield GaugeMetricFamily(
            "pagoda:kv_cache_usage_perc",
            "Fraction of KV-cache blocks in use (1 = full).",
            stat("kv_cache_usage"),
        )
        yield CounterMetricFamily(
            "pagoda:num_preemptions", "Cumulative preemptions.", stat("num_preemptions")
        )
        yield CounterMetricFamily(
            "pagoda:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            stat("prefix_cache_queries"),
        )
        yield CounterMetricFamily(
            "pagoda:prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            stat("prefix_cache_hits"),
        )


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "pagoda:time_to_first_token_seconds",
            "Arrival to first generated token.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pagoda:inter_token_latency_seconds",
            "Between consecutive generated tokens of a choice.",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pagoda:e2e_request_latency_seconds",
            "Arrival to finish.",
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "pagoda:request_queue_time_seconds",
            "Arrival to first scheduled.",
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("pagoda:prompt_tokens", "Prefilled prompt tokens.", registry=r)
        self.generation_tokens = Counter(
            "pagoda:generation_tokens", "Generated tokens.", registry=r
        )
        self.request_success = Counter(
            "pagoda:request_success",
            "Finished choices, by finish reason.",
            ["finished_reason"],
            registry=r,
        )

    def watch_engine(self, read_stats: Callable[[], Any], read_waiting: Callable[[], int]) -> None:
        self.registry.register(_EngineStatsCollector(read_stats, read_waiting))

    def on_outputs(
        self,
        outputs: list[RequestOutput],
        step_time: float,
        last_token_time: dict[tuple[str, int], float],
    ) -> None:
        """One step's outputs of one request; `last_token_time` is that request's state."""
        for out in outputs:
            key = (out.request_id, out.index)
            m = out.metrics
            if out.new_token_ids:
                previous = last_token_time.get(key)
                if previous is None:
                    self.ttft.observe((m.first_token_time or step_time) - m.arrival_time)
                    if out.index == 0:  # once per prompt, not per choice
                        self.prompt_tokens.inc(out.num_prompt_tokens)
                        if m.first_scheduled_time is not None:
                            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
                else:
                    self.itl.observe(step_time - previous)
                self.generation_tokens.inc(len(out.new_token_ids))
                last_token_time[key] = step_time
            if out.finished:
                self.e2e.observe((m.finished_time or step_time) - m.arrival_time)
                self.request_success.labels(finished_reason=out.finish_reason or "stop").inc()

    def on_abort(self, num_choices: int) -> None:
        if num_choices:
            self.request_success.labels(finished_reason="abort").inc(num_choices)
