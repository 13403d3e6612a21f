"""When load-test requests are sent: open loop on a seeded schedule, or closed loop."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterator

from clients.metrics import RequestRecord

# Sends request `index` and returns its filled-in record (never raises).
Send = Callable[[int], Awaitable[RequestRecord]]


def arrival_gaps(rate: float, burstiness: float, seed: int) -> Iterator[float]:
    """Seconds between consecutive sends, as in vLLM: gamma(shape=b, mean=1/rate)."""
    rng = random.Random(seed)
    while True:
        if math.isinf(rate):
            yield 0.0
        elif math.isinf(burstiness):
            yield 1.0 / rate
        else:
            yield rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


async def open_loop(
    send: Send,
    gaps: Iterator[float],
    num_requests: int,
    duration: float | None,
    start: float | None = None,
    share: tuple[int, int] = (0, 1),
) -> list[RequestRecord]:
    """Send on a schedule regardless of completions; the schedule is absolute, so no drift.

    share=(w, n): this is client process w of n; it sends the requests whose
    index is w mod n, at their times in the one schedule, from a common start."""
    start = time.perf_counter() if start is None else start
    worker, workers = share
    tasks: list[asyncio.Task[RequestRecord]] = []
    next_at = 0.0
    for index in itertools.count():
        if (num_requests and index >= num_requests) or (
            duration is not None and next_at >= duration
        ):
            break
        if index % workers == worker:
            delay = start + next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(index)))
        next_at += next(gaps)
    return list(await asyncio.gather(*tasks))


async def closed_loop(
    send: Send,
    concurrency: int,
    num_requests: int,
    duration: float | None,
    start: float | None = None,
    share: tuple[int, int] = (0, 1),
) -> list[RequestRecord]:
    """`concurrency` workers, each sending its next request when the last one finishes
    (with share=(w, n): of the indices w mod n)."""
    start = time.perf_counter() if start is None else start
    indices = itertools.count(*share)
    records: list[RequestRecord] = []

    async def worker() -> None:
        while True:
            index = next(indices)
            if num_requests and index >= num_requests:
                return
            if duration is not None and time.perf_counter() - start >= duration:
                return
            records.append(await send(index))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(records, key=lambda r: r.index)
