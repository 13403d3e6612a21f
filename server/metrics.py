"""Prometheus metrics, named as vLLM names them with the `pagoda:` prefix.

Each app owns a CollectorRegistry (tests build several apps in one process).
Gauges and the engine's cumulative counters are read at scrape time from the
stats snapshot the engine publishes after every step. Latencies and token counts
are observed on the event loop as outputs arrive, and not into prometheus_client's
metrics, which take a mutex per observation (one or more per token per stream):
each API process writes plain counts into its own row of a float64 buffer (shared
memory with several API processes), on its event loop, with no lock; a scrape, on
the same loop, sums every row.
"""

from __future__ import annotations

import bisect
import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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
    from server.async_engine import AsyncEngine  # which owns these metrics

# Latency buckets in seconds (vLLM's, trimmed).
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
_REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0,
)  # fmt: skip
# Token counts: vLLM's 1-2-5 series.
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))
FINISH_REASONS = ("stop", "length", "abort")
# The engine's cumulative counters, named as EngineStats names them.
_ENGINE_COUNTERS = {
    "num_preemptions": "Cumulative preemptions.",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "spec_decode_num_draft_tokens": "Draft tokens speculative decoding proposed.",
    "spec_decode_num_accepted_tokens": "Draft tokens speculative decoding accepted.",
}


class _EngineStatsCollector(Collector):
    """Reads the latest engine stats snapshot when /metrics is scraped."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.stats
        info = self._engine.info
        if info is not None:
            config = info.config
            cache = GaugeMetricFamily(
                "pagoda:cache_config_info",
                "The KV cache's settings, as labels (vLLM's cache_config_info).",
                labels=["block_size", "num_gpu_blocks", "enable_prefix_caching"],
            )
            blocks = "auto" if config.num_kv_blocks is None else str(config.num_kv_blocks)
            prefix = str(config.enable_prefix_caching)
            cache.add_metric([str(config.block_size), blocks, prefix], 1.0)
            yield cache

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
        for name, documentation in _ENGINE_COUNTERS.items():
            yield CounterMetricFamily(f"pagoda:{name}", documentation, stat(name))
        if stats is not None and stats.max_loras:
            lora = GaugeMetricFamily(
                "pagoda:lora_requests_info",
                "The adapters running and waiting requests use, as labels; the value is the "
                "time of the scrape (vLLM's lora_requests_info).",
                labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            )
            running, waiting = ",".join(stats.lora_running), ",".join(stats.lora_waiting)
            lora.add_metric([running, waiting, str(stats.max_loras)], time.time())
            yield lora


class Metrics:
    def __init__(self, share: MetricsShare | None = None) -> None:
        self.registry = CollectorRegistry()
        slots = self._slots = Slots()
        hist = functools.partial(LoopHistogram, slots=slots)
        tokens, seconds = _TOKEN_BUCKETS, _REQUEST_BUCKETS
        self.ttft = hist(
            "pagoda:time_to_first_token_seconds", "Arrival to first generated token.", _TTFT_BUCKETS
        )
        self.itl = hist(
            "pagoda:inter_token_latency_seconds",
            "Between consecutive generated tokens of a choice.",
            _ITL_BUCKETS,
        )
        self.e2e = hist("pagoda:e2e_request_latency_seconds", "Arrival to finish.", seconds)
        self.queue_time = hist(
            "pagoda:request_queue_time_seconds", "Arrival to first scheduled.", seconds
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
        self.iteration_tokens = hist(
            "pagoda:iteration_tokens_total",
            "Tokens per engine step: generated, and prompts' uncached tokens at their first.",
            tokens,
        )
        self.request_prompt_tokens = hist(
            "pagoda:request_prompt_tokens", "Prompt tokens of a finished request.", tokens
        )
        self.request_generation_tokens = hist(
            "pagoda:request_generation_tokens", "Generated tokens of a finished choice.", tokens
        )
        self.params_n = hist("pagoda:request_params_n", "The n of each request.", (1, 2, 5, 10, 20))
        self.params_max_tokens = hist(
            "pagoda:request_params_max_tokens", "The max_tokens of each request.", tokens
        )
        self.inference_time = hist(
            "pagoda:request_inference_time_seconds", "First scheduled to finished.", seconds
        )
        self.prefill_time = hist(
            "pagoda:request_prefill_time_seconds", "First scheduled to first token.", seconds
        )
        self.decode_time = hist(
            "pagoda:request_decode_time_seconds", "First token to finished.", seconds
        )
        # Requests this API process has submitted to the engine, ever: summed over
        # the processes and less the engine's count of those it has taken in, the
        # ones on their way (see AsyncEngine.num_waiting).
        self._submitted_slot = slots.take(1)
        slots.bind(share)
        self.registry.register(slots)

    @staticmethod
    def num_slots() -> int:
        """Floats one API process's numbers take (see MetricsShare)."""
        return Metrics()._slots.size

    def set_submitted(self, n: int) -> None:
        self._slots.own[self._submitted_slot] = n

    def submitted(self) -> int:
        """Requests submitted to the engine by every API process, ever."""
        return int(self._slots.total(self._submitted_slot))

    def watch_engine(self, engine: AsyncEngine) -> None:
        """Scrapes read the engine's latest stats from `engine` (called by AsyncEngine's
        constructor, which owns these metrics)."""
        self.registry.register(_EngineStatsCollector(engine))

    def on_submit(self, n: int, max_tokens: int | None) -> None:
        """A client request's parameters (vLLM's request_params_*)."""
        self.params_n.observe(n)
        if max_tokens is not None:
            self.params_max_tokens.observe(max_tokens)

    def on_step(self, num_tokens: int) -> None:
        if num_tokens:
            self.iteration_tokens.observe(num_tokens)

    def on_outputs(
        self,
        outputs: list[RequestOutput],
        step_time: float,
        last_token_time: dict[tuple[str, int], float],
    ) -> int:
        """One step's outputs of one request; `last_token_time` is that request's state.
        Returns the tokens they account for in the step (see iteration_tokens)."""
        num_tokens = 0
        for out in outputs:
            key = (out.request_id, out.index)
            m = out.metrics
            if out.new_token_ids:
                num_tokens += len(out.new_token_ids)
                previous = last_token_time.get(key)
                if previous is None:
                    self.ttft.observe((m.first_token_time or step_time) - m.arrival_time)
                    if out.index == 0:  # once per prompt, not per choice
                        self.prompt_tokens.inc(out.num_prompt_tokens)
                        num_tokens += out.num_prompt_tokens - out.num_cached_tokens
                        if m.first_scheduled_time is not None:
                            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
                else:
                    self.itl.observe(step_time - previous)
                if out.embedding is None:  # an embedding's one token is dropped, not generated
                    self.generation_tokens.inc(len(out.new_token_ids))
                last_token_time[key] = step_time
            if out.finished:
                self._on_finished(out, step_time)
        return num_tokens

    def _on_finished(self, out: RequestOutput, step_time: float) -> None:
        m = out.metrics
        finished = m.finished_time or step_time
        self.e2e.observe(finished - m.arrival_time)
        self.request_success.inc(1, out.finish_reason or "stop")
        if out.embedding is None:
            self.request_generation_tokens.observe(out.num_output_tokens)
        if out.index == 0:
            self.request_prompt_tokens.observe(out.num_prompt_tokens)
        if m.first_scheduled_time is not None:
            self.inference_time.observe(finished - m.first_scheduled_time)
            if m.first_token_time is not None:
                self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
        if m.first_token_time is not None:
            self.decode_time.observe(finished - m.first_token_time)

    def on_abort(self, num_choices: int) -> None:
        if num_choices:
            self.request_success.inc(num_choices, "abort")


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
