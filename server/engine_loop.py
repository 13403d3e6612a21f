"""EngineLoop: the side of the server that owns the engine.

The engine is not thread-safe, so one thread owns it: it builds it, drains a
locked inbox of new requests and aborts before every step, runs
`Engine.step()` while there is work and sleeps on a condition variable when
there is none. After every step it hands a StepReport (outputs, token deltas,
step time, stats) to whoever listens: the event loop of the same process (AsyncEngine's
engine thread), or the API server process over a pipe (server/engine_process.py).

Outputs are built only while the listener has credit: whoever delivers a
report with outputs spends it, and the listener's ack() returns it once it has
taken the report in. Until then tokens wait inside the engine, so a listener
that falls behind gets fewer, larger deltas instead of a backlog of one-token ones.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from engine.checks import RequestRejected, UnknownAdapter
from engine.config import STEP_PATHS, EngineConfig
from engine.distributed import WorkerFailed
from engine.heap import freeze_startup_heap
from engine.request import RequestOutput, TokenDeltas
from engine.sampling_params import SamplingParams
from server.errors import APIError, from_value_error

if TYPE_CHECKING:
    from engine.engine import Engine
    from engine.images import ImageInputs
    from engine.stats import EngineStats

logger = logging.getLogger("pagoda.server")

# With tensor parallelism, an idle loop looks this often whether a rank has died.
WORKERS_CHECK_S = 0.5

# engine request id -> that step's outputs for it, or the error that ends it
Batch = dict[str, "list[RequestOutput] | APIError"]


@dataclass
class StepReport:
    """What one iteration of the loop tells its listener."""

    batch: Batch  # outputs (the id-only outputs of plain streams are in deltas)
    deltas: TokenDeltas
    step_time: float  # wall-clock time (time.time()) the step's outputs were read
    stats: EngineStats
    # Requests the loop has taken from its inbox, ever: with the stats of the same
    # report, a listener counts those still on their way without counting one twice.
    taken_in: int
    done: list[str] = field(default_factory=list)  # LoRAUpdates made (refused: in batch), Syncs

    @property
    def has_news(self) -> bool:
        return bool(self.batch or self.deltas or self.done)


Listener = Callable[[StepReport], None]
EngineFactory = Callable[[EngineConfig], "Engine"]


def build_engine(config: EngineConfig) -> Engine:
    """The default factory. Here, not with the app: a spawned engine process imports
    it by name, and needs none of the HTTP side."""
    from engine.engine import Engine  # heavy (torch, the model code): only when serving

    return Engine(config)


@dataclass
class Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    images: ImageInputs | None = None  # the prompt's (engine/images.py)


@dataclass
class Abort:
    request_id: str


@dataclass
class LoRAUpdate:
    """Load a LoRA adapter (path) or unload one (path None), between two steps."""

    request_id: str  # its answer's key: in StepReport.done, or an error in the batch
    name: str
    path: str | None = None
    replace: bool = False  # new weights for a loaded name (vLLM's load_inplace)


@dataclass
class Sync:
    """Answered (in StepReport.done) by the engine's next report: once the answer is in,
    the sender has taken in every report made before, and their stats (an adapter
    another API process has just loaded, say)."""

    request_id: str


Item = Add | Abort | LoRAUpdate | Sync


class Credit(Protocol):
    """1 while the listener has taken the last report in (0: outputs wait). In the
    engine process, a shared-memory byte per API process, set there, not a message."""

    value: int


@dataclass
class Flag:
    """A Credit kept in this process."""

    value: int = 1


class EngineLoop:
    def __init__(
        self,
        config: EngineConfig,
        factory: EngineFactory,
        listener: Listener,
        credit: Credit | None = None,
    ) -> None:
        self._config = config
        self._factory = factory
        self._listener = listener
        self._cond = threading.Condition()
        self._inbox: list[Item] = []
        self._stopping = False
        self._woken = False
        self._credit = Flag() if credit is None else credit
        # Engine request id -> unfinished choices: the ids added and not yet finished,
        # failed or aborted (the owning thread's to change).
        self.active: dict[str, int] = {}
        self._stat_log: StatLog | None = None
        self._taken_in = 0
        self.engine: Engine | None = None

    # ------------------------------------------------------------ any thread

    def put(self, items: list[Item], wake: bool = False) -> None:
        """Queue items for the next step; wake: run an iteration (and report) even
        if there are none and nothing else to do."""
        with self._cond:
            self._inbox.extend(items)
            self._woken |= wake
            self._cond.notify()

    def ack(self) -> None:
        """The listener took the last report in: the next step may build outputs."""
        self._credit.value = 1

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()

    # ------------------------------------------------------------ the owning thread

    def build(self) -> Engine:
        self.engine = self._factory(self._config)
        if self._config.log_stats_interval > 0:  # its first interval starts now, not at startup
            self._stat_log = StatLog(self._config.log_stats_interval)
        freeze_startup_heap()  # the engine and its model live as long as the loop
        self._report({}, TokenDeltas(), [])
        return self.engine

    def serve(self) -> None:
        """Step until stopped; if the loop dies (or a tensor-parallel rank does), every
        request fails with a 500. The other ranks stop with it."""
        try:
            self._serve()
        except BaseException as exc:
            if isinstance(exc, WorkerFailed):
                logger.error("engine stopped: %s", exc)
                self._fail_all(APIError(f"The engine stopped: {exc}.", 500))
            else:
                logger.exception("engine loop died")
                self._fail_all(APIError("The engine thread died.", 500))
            with self._cond:
                self._stopping = True
        finally:
            self.engine.shutdown()

    @property
    def failed(self) -> bool:
        """A tensor-parallel rank has died (seen at once, even mid-step)."""
        workers = self.engine.workers if self.engine is not None else None
        return workers is not None and workers.failure is not None

    def _serve(self) -> None:
        engine = self.engine
        poll = WORKERS_CHECK_S if engine.workers is not None else None
        while True:
            with self._cond:
                while not (
                    self._inbox or self._stopping or self._woken or engine.has_unfinished_requests()
                ):
                    if poll is not None:
                        engine.workers.check()
                    slept = time.monotonic()
                    self._cond.wait(poll)
                    if self._stat_log is not None:
                        self._stat_log.idle(time.monotonic() - slept)
                inbox, self._inbox = self._inbox, []
                stopping, self._woken = self._stopping, False
            batch: Batch = {}
            deltas = TokenDeltas()
            done: list[str] = []
            added = self._drain(inbox, batch, done)
            if stopping:
                self._report({}, deltas, added, done)
                self._fail_all(APIError("The server is shutting down.", 503))
                return
            if engine.has_unfinished_requests():
                self._step(batch, deltas)
                if self._stat_log is not None:
                    self._stat_log.maybe_log(engine)
            self._report(batch, deltas, added, done)

    def _report(
        self, batch: Batch, deltas: TokenDeltas, added: list[str], done: list[str] | None = None
    ) -> None:
        self._taken_in += len(added)
        stats = self.engine.get_stats()
        report = StepReport(batch, deltas, time.time(), stats, self._taken_in, done or [])
        self._listener(report)

    def _drain(self, inbox: list[Item], batch: Batch, done: list[str]) -> list[str]:
        added = []
        vision = self.engine.vision
        images = [item.images for item in inbox if isinstance(item, Add) and item.images]
        if vision is not None and len(images) > 1:  # a burst's images through the tower at once
            vision.prefetch(images)
        for item in inbox:
            if isinstance(item, Abort):
                self._abort_in_engine(item.request_id)
                batch.pop(item.request_id, None)
                continue
            if isinstance(item, LoRAUpdate):
                self._update_lora(item, batch, done)
                continue
            if isinstance(item, Sync):
                done.append(item.request_id)
                continue
            added.append(item.request_id)
            try:
                self.engine.add_request(
                    item.request_id,
                    item.prompt_token_ids,
                    item.params,
                    item.arrival_time,
                    item.images,
                )
                self.active[item.request_id] = item.params.n
            except RequestRejected as exc:
                batch[item.request_id] = APIError(str(exc), 400, param=exc.param)
            except ValueError as exc:
                batch[item.request_id] = from_value_error(exc)
            except Exception:
                logger.exception("add_request failed for %s", item.request_id)
                batch[item.request_id] = APIError("The engine failed to add the request.", 500)
        if vision is not None and len(images) > 1:
            vision.forget()  # what a refused request left
        return added

    def _update_lora(self, item: LoRAUpdate, batch: Batch, done: list[str]) -> None:
        try:
            if item.path is None:
                self.engine.unload_lora(item.name)
            else:
                self.engine.load_lora(item.name, item.path, item.replace)
        except WorkerFailed:
            raise
        except UnknownAdapter as exc:
            batch[item.request_id] = APIError(str(exc), 404, code="model_not_found")
        except ValueError as exc:  # LoRAError: why the adapter cannot be served
            batch[item.request_id] = APIError(str(exc), 400)
        except Exception:
            logger.exception("loading LoRA adapter %r failed", item.name)
            batch[item.request_id] = APIError("The engine failed to load the adapter.", 500)
        else:
            done.append(item.request_id)

    def _step(self, batch: Batch, deltas: TokenDeltas) -> None:
        engine = self.engine
        try:
            # Without credit, tokens wait in the engine, and the listener's next
            # report gets one output per choice for all of them: under load,
            # per-token output work becomes per-chunk work.
            outputs = engine.step(emit=bool(self._credit.value), deltas=deltas)
            if engine.news and not engine.has_unfinished_requests():
                outputs = engine.take_outputs(deltas)  # no next step to report it: now
        except WorkerFailed:
            raise  # the engine cannot go on: serve() fails everything
        except Exception as exc:
            # Fail what the step touched (all running requests, unless the engine says
            # which) and keep serving the rest.
            logger.exception("engine step failed")
            touched = getattr(exc, "request_ids", None) or list(self.active)
            error = APIError("The engine failed while generating.", 500)
            for rid in touched:
                self._abort_in_engine(rid)
                batch[rid] = error
            return
        for out in outputs:
            if out.request_id not in self.active:
                continue
            entry = batch.setdefault(out.request_id, [])
            if isinstance(entry, list):
                entry.append(out)
            if out.finished:
                self.active[out.request_id] -= 1
                if self.active[out.request_id] == 0:
                    del self.active[out.request_id]

    def _abort_in_engine(self, request_id: str) -> None:
        """Abort an active request (a no-op for any other) and forget it."""
        if self.active.pop(request_id, None) is None:
            return
        try:
            self.engine.abort_request(request_id)
        except Exception:
            logger.exception("abort_request failed for %s", request_id)

    def _fail_all(self, error: APIError) -> None:
        batch: Batch = {}
        for rid in list(self.active):
            self._abort_in_engine(rid)
            batch[rid] = error
        with self._cond:  # requests still in the inbox fail too
            added = []
            for item in self._inbox:
                if isinstance(item, Add):
                    batch[item.request_id] = error
                    added.append(item.request_id)
                elif isinstance(item, (LoRAUpdate, Sync)):
                    batch[item.request_id] = error
            self._inbox.clear()
        if batch or added:
            self._report(batch, TokenDeltas(), added)


class StatLog:
    """The engine's periodic stats line (vLLM's LoggingStatLogger), logged only for
    intervals in which steps ran:

        engine: 311 steps/s (graph 84%, prefill graph 16%, eager 0%), 78907 sampled
        tok/s, running 256, waiting 109, KV cache 14.3%; host: working 100%, waiting
        on the device 0%, idle 0%

    Under load it says which side sets the pace: a host working ~100% of the time is
    the limit (the device waits for it); a host waiting on the device is not. The step
    mix says how many steps missed the decode CUDA graph."""

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
