"""AsyncEngine: the bridge between the event loop and the one engine thread.

The engine is not thread-safe, so one background thread owns it: it builds it,
drains a locked inbox of new requests and aborts before every step, runs
`Engine.step()` while there is work and sleeps on a condition variable when
there is none. Steps' outputs go into an outbox; one `call_soon_threadsafe`
delivers all that has gathered when the loop gets to it, sorting them into
per-request `RequestStream`s, so a busy loop is not woken once per step.
The event loop never touches the engine and never waits on the device.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from server.errors import APIError, from_value_error
from server.metrics import Metrics

logger = logging.getLogger("pagoda.server")
GIL_SWITCH_INTERVAL_S = 1e-4


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float


@dataclass
class _Abort:
    request_id: str


def coalesce(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """Merge the deltas of each choice into one (order of first appearance)."""
    groups: dict[tuple[str, int], list[RequestOutput]] = {}
    for out in outputs:
        groups.setdefault((out.request_id, out.index), []).append(out)
    merged = []
    for group in groups.values():
        if len(group) == 1:
            merged.append(group[0])
            continue
        logprobs = None
        if any(out.new_logprobs is not None for out in group):
            logprobs = [lp for out in group for lp in out.new_logprobs or []]
        merged.append(
            dataclasses.replace(
                group[-1],
                new_token_ids=[t for out in group for t in out.new_token_ids],
                new_text="".join(out.new_text for out in group),
                new_logprobs=logprobs,
            )
        )
    return merged


class RequestStream:
    """The outputs of one client request: one engine request per prompt, n choices each.

    Iterating yields, per engine step, the list of that step's RequestOutputs for
    this client request; an APIError ends it when the engine fails or shuts down.
    """

    def __init__(self, owner: AsyncEngine, request_ids: list[str], n: int) -> None:
        self.request_ids = request_ids
        self._owner = owner
        self._queue: asyncio.Queue[list[RequestOutput] | APIError] = asyncio.Queue()
        self._unfinished = {(rid, i) for rid in request_ids for i in range(n)}
        self.last_token_time: dict[tuple[str, int], float] = {}  # for inter-token latency
        self.finished = False
        self._error: APIError | None = None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> list[RequestOutput]:
        if self._error is not None:
            raise self._error
        if self.finished and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, APIError):
            raise item
        # Under load the loop falls behind the engine: hand over all that is queued,
        # merged per choice, so the client gets fewer, larger chunks, not a backlog.
        while not self._queue.empty():
            more = self._queue.get_nowait()
            if isinstance(more, APIError):
                self._error = more  # after the outputs that came before it
                break
            item = item + more
        return coalesce(item)

    def abort(self) -> None:
        """Stop generating (the client went away); idempotent, a no-op once finished."""
        if not self.finished:
            self.finished = True
            self._owner._abort(self)

    def _push(self, item: list[RequestOutput] | APIError) -> None:
        if isinstance(item, APIError):
            self.finished = True
            self._unfinished.clear()
        else:
            for out in item:
                if out.finished:
                    self._unfinished.discard((out.request_id, out.index))
            self.finished = not self._unfinished
        self._queue.put_nowait(item)

    @property
    def unfinished_choices(self) -> int:
        return len(self._unfinished)


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig,
        metrics: Metrics,
        max_waiting_requests: int,
        engine_factory: Callable[[EngineConfig], Any],
    ) -> None:
        self._config = config
        self._metrics = metrics
        self._max_waiting = max_waiting_requests
        self._factory = engine_factory
        self._cond = threading.Condition()
        self._inbox: list[_Add | _Abort] = []
        self._in_transit = 0  # submitted, not yet counted in a published stats snapshot
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # engine request id -> stream (loop side)
        # Steps' outputs waiting for the loop; a delivery is scheduled iff it is non-empty.
        self._outbox: list[tuple[dict, float]] = []
        self._outbox_lock = threading.Lock()
        self._active: dict[str, int] = {}  # engine request id -> unfinished choices (thread side)
        self.stats: Any = None  # the engine's latest EngineStats, published by the thread
        self.engine: Any = None  # set once built; the loop reads only its immutable attributes

    # ------------------------------------------------------------ loop side

    async def start(self) -> None:
        """Build the engine on its thread and wait until it is ready (or failed)."""
        self._loop = asyncio.get_running_loop()
        # The engine thread lets go of the GIL at every device sync; by default the
        # loop may then keep it for 5 ms, which would stretch every decode step.
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        ready: asyncio.Future[None] = self._loop.create_future()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="pagoda-engine", daemon=True
        )
        self._thread.start()
        await ready

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Abort whatever is in flight and join the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def num_waiting(self) -> int:
        with self._cond:
            return self._in_transit + (self.stats.num_waiting if self.stats else 0)

    def submit(
        self, request_id: str, prompts: list[list[int]], params: SamplingParams
    ) -> RequestStream:
        """Queue one engine request per prompt; 503 if the waiting queue is full."""
        if not self.is_alive:
            raise APIError("The engine is not running.", 503, code="service_unavailable")
        ids = [
            request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))
        ]
        stream = RequestStream(self, ids, params.n)
        now = time.time()
        with self._cond:
            waiting = self._in_transit + (self.stats.num_waiting if self.stats else 0)
            if waiting >= self._max_waiting:
                raise APIError(
                    f"The server is overloaded: {waiting} requests are waiting "
                    f"(limit {self._max_waiting}). Retry later.",
                    503,
                    code="server_overloaded",
                )
            self._in_transit += len(prompts)
            self._inbox.extend(
                _Add(rid, p, params, now) for rid, p in zip(ids, prompts, strict=True)
            )
            self._cond.notify()
        for rid in ids:
            self._streams[rid] = stream
        return stream

    def _abort(self, stream: RequestStream) -> None:
        self._metrics.on_abort(stream.unfinished_choices)
        self._forget(stream)

    def _forget(self, stream: RequestStream) -> None:
        """Stop routing to the stream and abort its engine requests (a no-op for finished ones)."""
        for rid in stream.request_ids:
            self._streams.pop(rid, None)
        with self._cond:
            self._inbox.extend(_Abort(rid) for rid in stream.request_ids)
            self._cond.notify()

    def _deliver(self) -> None:
        """Runs on the loop, at its own pace: everything the engine stepped out since the
        last delivery, each stream pushed once (a busy loop gets fewer, fuller wakes)."""
        with self._outbox_lock:
            steps, self._outbox = self._outbox, []
        per_stream: dict[int, tuple[RequestStream, list[RequestOutput]]] = {}
        for batch, step_time in steps:
            for rid, item in batch.items():
                stream = self._streams.get(rid)
                if stream is None:  # aborted by the client meanwhile
                    continue
                if isinstance(item, APIError):
                    # One prompt failed: the client request fails, so its other prompts stop too.
                    per_stream.pop(id(stream), None)
                    stream._push(item)
                    self._forget(stream)
                    continue
                self._metrics.on_outputs(item, step_time, stream.last_token_time)
                per_stream.setdefault(id(stream), (stream, []))[1].extend(item)
        for stream, outputs in per_stream.values():
            if stream.finished:  # failed above, in this same delivery
                continue
            stream._push(outputs)
            if stream.finished:
                for rid in stream.request_ids:
                    self._streams.pop(rid, None)

    # ------------------------------------------------------------ engine thread

    def _run(self, ready: asyncio.Future[None]) -> None:
        assert self._loop is not None
        try:
            self.engine = self._factory(self._config)
            self._publish_stats(0)
        except BaseException as exc:  # surfaces in start(): the server does not come up
            self._loop.call_soon_threadsafe(_set_exception, ready, exc)
            return
        self._loop.call_soon_threadsafe(_set_result, ready)
        try:
            self._serve()
        except BaseException:
            logger.exception("engine thread died")
            self._fail_all(APIError("The engine thread died.", 500))
            with self._cond:
                self._stopping = True

    def _serve(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not (self._inbox or self._stopping or engine.has_unfinished_requests()):
                    self._cond.wait()
                inbox, self._inbox = self._inbox, []
                stopping = self._stopping
            batch: dict[str, list[RequestOutput] | APIError] = {}
            num_added = self._drain(inbox, batch)
            if stopping:
                self._publish_stats(num_added)
                self._fail_all(APIError("The server is shutting down.", 503))
                return
            step_time = time.time()
            if engine.has_unfinished_requests():
                self._step(batch)
                step_time = time.time()
            self._publish_stats(num_added)
            if batch:
                self._send(batch, step_time)

    def _drain(self, inbox: list[_Add | _Abort], batch: dict) -> int:
        num_added = 0
        for item in inbox:
            if isinstance(item, _Abort):
                if self._active.pop(item.request_id, None) is not None:
                    self._abort_in_engine(item.request_id)
                batch.pop(item.request_id, None)
                continue
            num_added += 1
            try:
                self.engine.add_request(
                    item.request_id, item.prompt_token_ids, item.params, item.arrival_time
                )
                self._active[item.request_id] = item.params.n
            except ValueError as exc:
                batch[item.request_id] = from_value_error(exc)
            except Exception as exc:
                logger.exception("add_request failed for %s", item.request_id)
                batch[item.request_id] = APIError(
                    f"The engine failed to add the request: {exc}", 500
                )
        return num_added

    def _step(self, batch: dict) -> None:
        engine = self.engine
        try:
            # While the loop has not yet taken the last delivery, tokens wait in the
            # engine, and the loop's next delivery gets one output per choice for
            # all of them: under load, per-token work shrinks to per-chunk work.
            outputs = engine.step(emit=not self._outbox)
            if engine.news and not engine.has_unfinished_requests():
                outputs = engine.take_outputs()  # no next step to report it: now
        except Exception as exc:
            # Fail what the step touched (all running requests, unless the engine says
            # which) and keep serving the rest.
            logger.exception("engine step failed")
            touched = getattr(exc, "request_ids", None) or list(self._active)
            error = APIError(f"The engine failed while generating: {exc}", 500)
            for rid in touched:
                if self._active.pop(rid, None) is not None:
                    self._abort_in_engine(rid)
                batch[rid] = error
            return
        for out in outputs:
            if out.request_id not in self._active:
                continue
            entry = batch.setdefault(out.request_id, [])
            if isinstance(entry, list):
                entry.append(out)
            if out.finished:
                self._active[out.request_id] -= 1
                if self._active[out.request_id] == 0:
                    del self._active[out.request_id]

    def _abort_in_engine(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except Exception:
            logger.exception("abort_request failed for %s", request_id)

    def _fail_all(self, error: APIError) -> None:
        batch: dict[str, list[RequestOutput] | APIError] = {}
        for rid in list(self._active):
            self._abort_in_engine(rid)
            batch[rid] = error
        self._active.clear()
        with self._cond:  # requests still in the inbox fail too
            for item in self._inbox:
                if isinstance(item, _Add):
                    batch[item.request_id] = error
            self._inbox.clear()
            self._in_transit = 0
        if batch:
            self._send(batch, time.time())

    def _publish_stats(self, num_added: int) -> None:
        stats = self.engine.get_stats()
        with self._cond:
            self.stats = stats
            self._in_transit -= num_added

    def _send(self, batch: dict, step_time: float) -> None:
        with self._outbox_lock:
            self._outbox.append((batch, step_time))
            if len(self._outbox) > 1:
                return  # a delivery is already scheduled and will take this too
        # RuntimeError: the loop has closed, so nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._deliver)


def _set_result(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _set_exception(future: asyncio.Future[None], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
