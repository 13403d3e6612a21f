"""The engine's periodic stats line (vLLM's LoggingStatLogger), from the loop that owns it.

    engine: 311 steps/s (graph 84%, prefill graph 16%, eager 0%), 78907 sampled tok/s,
    running 256, waiting 109, KV cache 14.3%; host: working 100%, waiting on the
    device 0%, idle 0%

Under load it says which side sets the pace: a host working ~100% of the time
is the limit (the device waits for it); a host waiting on the device is not.
The step mix says how many steps missed the decode CUDA graph. Logged only for
intervals in which steps ran.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from engine.config import STEP_PATHS

logger = logging.getLogger("pagoda.server")


class StatLog:
    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._start = time.monotonic()
        self._idle_s = 0.0
        self._last: dict[str, float] | None = None

    def idle(self, seconds: float) -> None:
        """The loop slept this long with nothing to do."""
        self._idle_s += seconds

    def maybe_log(self, engine: Any) -> None:
        now = time.monotonic()
        if now - self._start < self.interval_s:
            return
        runner = engine.runner
        totals = {**runner.steps_by_path, "wait": runner.wait_s, "sampled": engine.num_sampled}
        last, self._last = self._last or dict.fromkeys(totals, 0), totals
        elapsed, idle = now - self._start, self._idle_s
        self._start, self._idle_s = now, 0.0
        delta = {k: totals[k] - last[k] for k in totals}
        steps = sum(delta[p] for p in STEP_PATHS)
        if not steps:
            return
        mix = ", ".join(f"{p} {100 * delta[p] / steps:.0f}%" for p in STEP_PATHS)
        stats = engine.get_stats()
        working = max(0.0, elapsed - delta["wait"] - idle)
        logger.info(
            "engine: %.0f steps/s (%s), %.0f sampled tok/s, running %d, waiting %d, "
            "KV cache %.1f%%; host: working %.0f%%, waiting on the device %.0f%%, idle %.0f%%",
            steps / elapsed, mix, delta["sampled"] / elapsed, stats.num_running,
            stats.num_waiting, 100 * stats.kv_cache_usage, 100 * working / elapsed,
            100 * delta["wait"] / elapsed, 100 * idle / elapsed,
        )  # fmt: skip
