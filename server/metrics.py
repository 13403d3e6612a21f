"""Prometheus metrics, named as vLLM names them with the `pagoda:` prefix.

Each app owns a CollectorRegistry (tests build several apps in one process).
Gauges and the engine's cumulative counters are read at scrape time from the
stats snapshot the engine thread publishes after every step; latencies and
token counts are observed on the event loop as outputs arrive. With several
API processes, those numbers live in shared memory, a row per process, and
every scrape sums the rows.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from engine.request import RequestOutput

if TYPE_CHECKING:
    from engine.engine import EngineStats

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
FINISH_REASONS = ("stop", "length", "abort")
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


class EngineWatch(Protocol):
    """What the metrics read of the engine at scrape time (AsyncEngine)."""

    @property
    def stats(self) -> EngineStats | None: ...

    @property
    def num_waiting(self) -> int: ...


class _EngineStatsCollector(Collector):
    """Reads the latest engine stats snapshot when /metrics is scraped."""

    def __init__(self, engine: EngineWatch) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.stats

        def stat(name: str) -> float:
            return float(getattr(stats, name, 0) or 0) if stats is not None else 0.0

        yield GaugeMetricFamily(
            "pagoda:num_requests_running", "Requests in the running batch.", stat("num_running")
        )
        yield GaugeMetricFamily(
            "pagoda:num_requests_waiting",
            "Requests waiting to be scheduled.",
            float(self._engine.num_waiting),
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


class Slots:
    """Hands out float64 slots; once every metric has taken its share, bind() gives
    the numbers their storage: one row per API process, of which this process
    writes only its own, on its event loop (no lock), while reads sum all rows,
    so any API process answers /metrics for all of them."""

    def __init__(self) -> None:
        self.size = 0
        self.own: memoryview = memoryview(b"")  # this process's row
        self.rows: list[memoryview] = []  # every process's row, this one included

    def take(self, n: int) -> int:
        self.size += n
        return self.size - n

    def bind(self, share: MetricsShare | None) -> None:
        if share is None:
            share = MetricsShare(bytearray(8 * self.size), 0, 1)
        flat = memoryview(share.buffer).cast("B").cast("d")
        self.rows = [flat[i * self.size : (i + 1) * self.size] for i in range(share.count)]
        self.own = self.rows[share.index]

    def total(self, slot: int) -> float:
        return sum(row[slot] for row in self.rows)


@dataclass
class MetricsShare:
    """Where API process `index` of `count` keeps its numbers: a shared float64
    buffer of count * Metrics.num_slots() (a multiprocessing RawArray)."""

    buffer: Any
    index: int
    count: int


class LoopHistogram:
    """A histogram fed only from the event loop: plain counts, no lock.

    prometheus_client's metrics take a mutex per observation; at one or more
    observations per token per stream that was over a third of the loop's time
    under load. Scrapes run on the same loop, so nothing here needs a lock."""

    def __init__(
        self, name: str, documentation: str, buckets: tuple[float, ...], slots: Slots
    ) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = list(buckets)
        self.slots = slots
        self.base = slots.take(len(buckets) + 2)  # counts (the last bucket is +Inf), sum
        self.sum_slot = self.base + len(buckets) + 1

    def observe(self, value: float) -> None:
        row = self.slots.own
        row[self.base + bisect.bisect_left(self.bounds, value)] += 1
        row[self.sum_slot] += value

    def family(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation)
        cumulative, buckets = 0.0, []
        for i, bound in enumerate([*map(str, self.bounds), "+Inf"]):
            cumulative += self.slots.total(self.base + i)
            buckets.append((bound, cumulative))
        family.add_metric([], buckets, self.slots.total(self.sum_slot))
        return family


class LoopCounter:
    """A counter fed only from the event loop (see LoopHistogram), optionally by one
    label whose values are known up front (a label value not yet counted is not shown)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        slots: Slots,
        label: str | None = None,
        label_values: tuple[str, ...] = ("",),
    ) -> None:
        self.name, self.documentation, self.label = name, documentation, label
        self.slots = slots
        self.base = slots.take(len(label_values))
        self.index = {value: self.base + i for i, value in enumerate(label_values)}

    def inc(self, amount: float = 1.0, label_value: str = "") -> None:
        self.slots.own[self.index[label_value]] += amount

    def family(self) -> Metric:
        labels = [self.label] if self.label else []
        family = CounterMetricFamily(self.name, self.documentation, labels=labels)
        for value, slot in self.index.items():
            total = self.slots.total(slot)
            if self.label is None:
                family.add_metric([], total)
            elif total:
                family.add_metric([value], total)
        return family


class _LoopMetricsCollector(Collector):
    def __init__(self, metrics: list[LoopHistogram | LoopCounter]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        for metric in self._metrics:
            yield metric.family()


class Metrics:
    def __init__(self, share: MetricsShare | None = None) -> None:
        self.registry = CollectorRegistry()
        slots = self._slots = Slots()
        self.ttft = LoopHistogram(
            "pagoda:time_to_first_token_seconds",
            "Arrival to first generated token.",
            _TTFT_BUCKETS,
            slots,
        )
        self.itl = LoopHistogram(
            "pagoda:inter_token_latency_seconds",
            "Between consecutive generated tokens of a choice.",
            _ITL_BUCKETS,
            slots,
        )
        self.e2e = LoopHistogram(
            "pagoda:e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_BUCKETS, slots
        )
        self.queue_time = LoopHistogram(
            "pagoda:request_queue_time_seconds",
            "Arrival to first scheduled.",
            _REQUEST_BUCKETS,
            slots,
        )
        self.prompt_tokens = LoopCounter("pagoda:prompt_tokens", "Prefilled prompt tokens.", slots)
        self.generation_tokens = LoopCounter("pagoda:generation_tokens", "Generated tokens.", slots)
        self.request_success = LoopCounter(
            "pagoda:request_success",
            "Finished choices, by finish reason.",
            slots,
            "finished_reason",
            FINISH_REASONS,
        )
        # Requests this API process has submitted to the engine, ever: summed over
        # the processes and less the engine's count of those it has taken in, the
        # ones on their way (see AsyncEngine.num_waiting).
        self._submitted_slot = slots.take(1)
        slots.bind(share)
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

    @staticmethod
    def num_slots() -> int:
        """Floats one API process's numbers take (see MetricsShare)."""
        return Metrics()._slots.size

    def set_submitted(self, n: int) -> None:
        self._slots.own[self._submitted_slot] = n

    def submitted(self) -> int:
        """Requests submitted to the engine by every API process, ever."""
        return int(self._slots.total(self._submitted_slot))

    def watch_engine(self, engine: EngineWatch) -> None:
        """Scrapes read the engine's latest stats from `engine` (called by AsyncEngine's
        constructor, which owns these metrics)."""
        self.registry.register(_EngineStatsCollector(engine))

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
