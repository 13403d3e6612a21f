"""Serving metrics as vLLM's benchmark_serving defines them, computed from raw records.

Everything here is a pure function of `RequestRecord`s (timestamps taken by the
client, token counts reported by the server), so tests can rebuild every number
from the timestamps by hand.

Definitions (all latencies reported in ms):
- TTFT: request sent -> first chunk carrying generated text.
- ITL:  every gap between two consecutive content chunks, pooled over requests.
- TPOT: (E2E - TTFT) / (output_tokens - 1), only for requests with > 1 output token.
- E2E:  request sent -> end of the stream (`data: [DONE]`).
- Throughputs divide by the benchmark duration (first send -> last request done).
- Goodput: completed requests per second that met every given SLO.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from itertools import pairwise

import numpy as np

PERCENTILES = (50, 90, 95, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    """What the client saw of one request. Times are `time.perf_counter()` seconds."""

    index: int
    send_time: float = 0.0
    # Arrival time of each chunk that carried generated text, in order.
    chunk_times: list[float] = field(default_factory=list)
    end_time: float | None = None
    # Token counts from the server's usage chunk; None when it sent none.
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    requested_max_tokens: int | None = None
    text: str = ""
    error: str | None = None
    # One of: http, stream, timeout, connection, protocol.
    error_kind: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def usage_reported(self) -> bool:
        return self.completion_tokens is not None

    @property
    def output_tokens(self) -> int:
        # Chunk count is only a fallback: a server may pack several tokens in one chunk.
        if self.completion_tokens is not None:
            return self.completion_tokens
        return len(self.chunk_times)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.send_time if self.chunk_times else None

    @property
    def latency(self) -> float | None:
        return None if self.end_time is None else self.end_time - self.send_time

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in pairwise(self.chunk_times)]

    @property
    def tpot(self) -> float | None:
        ttft, latency = self.ttft, self.latency
        if ttft is None or latency is None or self.output_tokens <= 1:
            return None
        return (latency - ttft) / (self.output_tokens - 1)

    def fail(self, kind: str, message: str) -> None:
        # The first failure is the cause; later ones (e.g. a timeout while closing) are noise.
        if self.error is None:
            self.error_kind, self.error = kind, message

    def to_json(self, t0: float = 0.0) -> dict:
        """Raw record with times shifted so that t0 (the benchmark start) is 0."""
        d = asdict(self)
        d["send_time"] = self.send_time - t0
        d["chunk_times"] = [t - t0 for t in self.chunk_times]
        d["end_time"] = None if self.end_time is None else self.end_time - t0
        return d

    @classmethod
    def from_json(cls, d: dict) -> RequestRecord:
        return cls(**d)


@dataclass
class Stats:
    """Distribution summary in milliseconds."""

    mean: float
    std: float
    p50: float
    p90: float
    p95: float
    p99: float
    max: float
    count: int

    @classmethod
    def of(cls, seconds: list[float]) -> Stats | None:
        if not seconds:
            return None
        ms = np.asarray(seconds, dtype=np.float64) * 1000.0
        p50, p90, p95, p99 = (float(np.percentile(ms, p)) for p in PERCENTILES)
        return cls(
            mean=float(ms.mean()),
            std=float(ms.std()),  # population std, as vLLM reports it
            p50=p50,
            p90=p90,
            p95=p95,
            p99=p99,
            max=float(ms.max()),
            count=len(seconds),
        )


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float | None
    slos_ms: dict[str, float]
    ttft: Stats | None
    tpot: Stats | None
    itl: Stats | None
    e2el: Stats | None
    # error kind -> count, and distinct messages with their counts (most frequent first).
    errors: dict[str, int]
    error_messages: list[tuple[str, int]]
    # Completed requests whose server sent no usage chunk: output tokens are chunk counts.
    usage_missing: int

    def to_json(self) -> dict:
        d = asdict(self)
        d["error_messages"] = [{"message": m, "count": n} for m, n in self.error_messages]
        return d


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` -> `{"ttft": 200.0, "tpot": 50.0}` (ms)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"bad --goodput item {item!r}: want NAME:MS, NAME in {SLO_METRICS}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"bad --goodput value in {item!r}: not a number of ms") from None
        if slos[name] < 0:
            raise ValueError(f"bad --goodput value in {item!r}: negative")
    return slos


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    # A request that never produced text cannot meet a TTFT target; a one-token
    # request has TPOT 0, as in vLLM.
    values = {
        "ttft": record.ttft,
        "tpot": record.tpot if record.output_tokens > 1 else 0.0,
        "e2el": record.latency,
    }
    for name, limit in slos_ms.items():
        value = values[name]
        if value is None or value * 1000.0 > limit:
            return False
    return True


def last_end(records: list[RequestRecord]) -> float | None:
    """When the last request was done: the latest end (or last chunk, or send)."""
    if not records:
        return None
    ends = [r.end_time if r.end_time is not None else r.send_time for r in records]
    ends += [r.chunk_times[-1] for r in records if r.chunk_times]
    return max(ends)


def benchmark_span(records: list[RequestRecord]) -> float:
    """First send -> last end, for callers without their own start time."""
    end = last_end(records)
    return 0.0 if end is None else end - min(r.send_time for r in records)


def compute_metrics(
    records: list[RequestRecord],
    duration_s: float | None = None,
    slos_ms: dict[str, float] | None = None,
) -> BenchmarkMetrics:
    """Aggregate raw records. Failed requests count only in the error figures."""
    slos_ms = dict(slos_ms or {})
    duration = benchmark_span(records) if duration_s is None else duration_s
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]

    total_in = sum(r.prompt_tokens or 0 for r in done)
    total_out = sum(r.output_tokens for r in done)

    def rate(x: float) -> float:
        return x / duration if duration > 0 else 0.0

    goodput = None
    if slos_ms:
        goodput = rate(sum(meets_slos(r, slos_ms) for r in done))

    return BenchmarkMetrics(
        completed=len(done),
        failed=len(failed),
        duration_s=duration,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=rate(len(done)),
        output_throughput=rate(total_out),
        total_token_throughput=rate(total_in + total_out),
        goodput=goodput,
        slos_ms=slos_ms,
        ttft=Stats.of([r.ttft for r in done if r.ttft is not None]),
        tpot=Stats.of([r.tpot for r in done if r.tpot is not None]),
        itl=Stats.of([gap for r in done for gap in r.itls]),
        e2el=Stats.of([r.latency for r in done if r.latency is not None]),
        errors=dict(Counter(r.error_kind or "unknown" for r in failed)),
        error_messages=Counter(r.error or "" for r in failed).most_common(),
        usage_missing=sum(not r.usage_reported for r in done),
    )


def throughput_timeline(
    records: list[RequestRecord], t0: float, bin_s: float = 1.0
) -> tuple[list[float], list[float]]:
    """Output tokens/s per time bin since t0, for completed requests.

    A request's tokens are spread evenly over its content chunks, so a server
    that packs several tokens per chunk is still counted by its usage figure.
    """
    done = [r for r in records if r.ok and r.chunk_times]
    if not done or bin_s <= 0:
        return [], []
    last = max(r.chunk_times[-1] for r in done) - t0
    counts = np.zeros(max(1, math.ceil(last / bin_s + 1e-9)))
    for r in done:
        per_chunk = r.output_tokens / len(r.chunk_times)
        for t in r.chunk_times:
            counts[min(int((t - t0) / bin_s), len(counts) - 1)] += per_chunk
    starts = [i * bin_s for i in range(len(counts))]
    return starts, [float(c / bin_s) for c in counts]
