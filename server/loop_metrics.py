"""Metrics fed only from the event loop, in float64 slots shared by the API processes.

prometheus_client's metrics take a mutex per observation; at one or more
observations per token per stream that was over a third of the loop's time
under load. Here each API process writes plain counts into its own row of a
buffer (shared memory with several API processes), on its event loop, with no
lock; a scrape, on the same loop, sums every row.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector


class Slots(Collector):
    """Hands out float64 slots; once every metric has taken its share, bind() gives
    the numbers their storage: one row per API process, of which this process
    writes only its own, on its event loop (no lock), while reads sum all rows,
    so any API process answers /metrics for all of them. Collects its metrics."""

    def __init__(self) -> None:
        self.size = 0
        self.own: memoryview = memoryview(b"")  # this process's row
        self.rows: list[memoryview] = []  # every process's row, this one included
        self.metrics: list[LoopHistogram | LoopCounter] = []  # in the order they were made

    def take(self, n: int, metric: LoopHistogram | LoopCounter | None = None) -> int:
        if metric is not None:
            self.metrics.append(metric)
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

    def collect(self) -> Iterator[Metric]:
        for metric in self.metrics:
            yield metric.family()


@dataclass
class MetricsShare:
    """Where API process `index` of `count` keeps its numbers: a shared float64
    buffer of count * Metrics.num_slots() (a multiprocessing RawArray)."""

    buffer: Any
    index: int
    count: int


class LoopHistogram:
    """A histogram fed only from the event loop: plain counts, no lock."""

    def __init__(
        self, name: str, documentation: str, buckets: tuple[float, ...], slots: Slots
    ) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = list(buckets)
        self.slots = slots
        self.base = slots.take(len(buckets) + 2, self)  # counts (the last bucket is +Inf), sum
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
    """A counter fed only from the event loop, optionally by one label whose values
    are known up front (a label value not yet counted is not shown)."""

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
        self.base = slots.take(len(label_values), self)
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
