"""Prometheus metrics, named as vLLM names them with the `pagoda:` prefix.

Each app owns a CollectorRegistry (tests build several apps in one process).
Gauges and the engine's cumulative counters are read at scrape time from the
stats snapshot the engine thread publishes after every step; latencies and
token counts are observed on the event loop as outputs arrive.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
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


class LoopHistogram:
    """A histogram fed only from the event loop: plain counts, no lock.

    prometheus_client's metrics take a mutex per observation; at one or more
    observations per token per stream that was over a third of the loop's time
    under load. Scrapes run on the same loop, so nothing here needs a lock."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)  # the last bucket is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation)
        cumulative, buckets = 0, []
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts):
            cumulative += count
            buckets.append((bound, cumulative))
        family.add_metric([], buckets, self.sum)
        return family


class LoopCounter:
    """A counter fed only from the event loop (see LoopHistogram), optionally by one label."""

    def __init__(self, name: str, documentation: str, label: str | None = None) -> None:
        self.name, self.documentation, self.label = name, documentation, label
        self.values: dict[str, float] = {}

    def inc(self, amount: float = 1.0, label_value: str = "") -> None:
        self.values[label_value] = self.values.get(label_value, 0.0) + amount

    def family(self) -> Metric:
        labels = [self.label] if self.label else []
        family = CounterMetricFamily(self.name, self.documentation, labels=labels)
        for value, total in self.values.items():
            family.add_metric([value] if self.label else [], total)
        if not self.values and not self.label:
            family.add_metric([], 0.0)
        return family


class _LoopMetricsCollector(Collector):
    def __init__(self, metrics: list[LoopHistogram | LoopCounter]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        for metric in self._metrics:
            yield metric.family()


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.ttft = LoopHistogram(
            "pagoda:time_to_first_token_seconds", "Arrival to first generated token.", _TTFT_BUCKETS
        )
        self.itl = LoopHistogram(
            "pagoda:inter_token_latency_seconds",
            "Between consecutive generated tokens of a choice.",
            _ITL_BUCKETS,
        )
        self.e2e = LoopHistogram(
            "pagoda:e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_BUCKETS
        )
        self.queue_time = LoopHistogram(
            "pagoda:request_queue_time_seconds", "Arrival to first scheduled.", _REQUEST_BUCKETS
        )
        self.prompt_tokens = LoopCounter("pagoda:prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = LoopCounter("pagoda:generation_tokens", "Generated tokens.")
        self.request_success = LoopCounter(
            "pagoda:request_success", "Finished choices, by finish reason.", "finished_reason"
        )
        self.registry.register(
            _LoopMetricsCollector(
                [
                    self.ttft,
                    self.itl,
                    self.e2e,
                    self.queue_time,
                    self.prompt_tokens,
                    self.generation_tokens,
                    self.request_success,
                ]
            )
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
                self.request_success.inc(1, out.finish_reason or "stop")

    def on_abort(self, num_choices: int) -> None:
        if num_choices:
            self.request_success.inc(num_choices, "abort")
