"""AsyncEngine: the bridge between the event loop and the engine.

The engine side is an EngineLoop (server/engine_loop.py): by default on a
background thread of this process, with `--engine-process` in a process of its
own (server/engine_process.py), which with `--api-server-count` several API
processes share (server/api_servers.py). Either way, steps' reports go into an outbox;
one `call_soon_threadsafe` delivers all that has gathered when the loop gets
to it, sorting them into per-request `RequestStream`s, so a busy loop is not
woken once per step, and each delivery acks the engine side, which builds
outputs only when acked. The event loop never touches the engine and never
waits on the device.
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
from typing import Any

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer, byte_table
from engine.request import RequestOutput, TokenDeltas, follow
from engine.sampling_params import SamplingParams
from server.engine_loop import Abort, Add, Batch, EngineLoop, Flag
from server.engine_process import EngineEndpoint, EngineProcess
from server.errors import APIError
from server.metrics import Metrics

logger = logging.getLogger("pagoda.server")
GIL_SWITCH_INTERVAL_S = 1e-4


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

    def __init__(
        self,
        owner: AsyncEngine,
        request_ids: list[str],
        n: int,
        detokenizers: dict[tuple[str, int], IncrementalDetokenizer] | None = None,
    ) -> None:
        self.request_ids = request_ids
        self._owner = owner
        # (engine request id, choice) -> its decoder, when the engine sends ids only.
        self._detokenizers = detokenizers
        self._queue: asyncio.Queue[list[RequestOutput] | APIError] = asyncio.Queue()
        self._unfinished = {(rid, i) for rid in request_ids for i in range(n)}
        self.last_token_time: dict[tuple[str, int], float] = {}  # for inter-token latency
        # Each choice's latest output, which the next TokenDeltas entry follows.
        self.last_output: dict[tuple[str, int], RequestOutput] = {}
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
            if self._detokenizers is not None:
                for out in item:  # in step order, as the engine would have decoded them
                    decoder = self._detokenizers[out.request_id, out.index]
                    decoder.update(out.new_token_ids)
                    out.new_text = decoder.get_delta(out.finished)
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
        engine_process: bool = False,
        engine_endpoint: EngineEndpoint | None = None,
    ) -> None:
        self._config = config
        self._metrics = metrics
        self._max_waiting = max_waiting_requests
        self._factory = engine_factory
        # With an endpoint, the engine process is someone else's and already started.
        self._use_process = engine_process or engine_endpoint is not None
        self._endpoint = engine_endpoint
        self._credit = Flag()  # the engine thread's (an engine process keeps its own)
        self._backend: EngineLoop | EngineProcess | None = None
        self._thread: threading.Thread | None = None  # the engine thread (not with a process)
        self._lock = threading.Lock()  # stats, _taken_in and _submitted
        self._submitted = 0  # engine requests this process has submitted, ever
        # How many requests the engine had taken in (from every API process) when it
        # made self.stats: the two come in one report, so they always agree.
        self._taken_in = 0
        self._num_taken_in = 0  # the engine thread's running count (no engine process)
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # engine request id -> stream (loop side)
        # Steps' outputs waiting for the loop; a delivery is scheduled iff it is non-empty.
        self._outbox: list[tuple[Batch, TokenDeltas, float]] = []
        self._outbox_lock = threading.Lock()
        # Adds and aborts of this loop iteration, handed over in one put (one pipe
        # write with --engine-process) instead of one per request.
        self._puts: list[Add | Abort] = []
        self.stats: Any = None  # the engine's latest EngineStats
        # The engine once built (an EngineInfo with --engine-process); the loop reads
        # only its immutable attributes.
        self.engine: Any = None

    # ------------------------------------------------------------ loop side

    async def start(self) -> None:
        """Build the engine (on its thread or in its process); wait until it is ready."""
        self._loop = asyncio.get_running_loop()
        # A thread that waits for the GIL gets it after this long at most; by default
        # (5 ms) a busy loop would stretch every decode step.
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        if self._use_process:
            from engine.models.loader import load_tokenizer

            process = EngineProcess(
                self._config, self._factory, self._report, self._engine_exited,
                GIL_SWITCH_INTERVAL_S, self._endpoint,
            )  # fmt: skip
            self._backend = process
            info = await process.start()
            info.tokenizer = await asyncio.to_thread(load_tokenizer, info.model_dir)
            await asyncio.to_thread(byte_table, info.tokenizer)  # built once, before a request
            self.engine = info
            return
        ready: asyncio.Future[None] = self._loop.create_future()
        self._backend = EngineLoop(self._config, self._factory, self._report_local, self._credit)
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="pagoda-engine", daemon=True
        )
        self._thread.start()
        await ready
        self.engine = self._backend.engine

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Abort whatever is in flight and stop the engine side."""
        self._stopping = True
        if self._backend is None:
            return
        self._flush_puts()  # requests submitted just now fail with the rest, not hang
        self._backend.stop()
        if isinstance(self._backend, EngineProcess):
            await asyncio.to_thread(self._backend.join, timeout)
        elif self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)

    @property
    def is_alive(self) -> bool:
        if self._stopping or self._backend is None:
            return False
        if isinstance(self._backend, EngineProcess):
            return self._backend.is_alive
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        """Waiting in the engine, or on the way there from any API process."""
        with self._lock:
            return self._num_waiting()

    def _num_waiting(self) -> int:
        # Every process's submissions, less those the engine had taken in by its
        # stats snapshot, plus those it counted waiting in it: a request is counted
        # once, whichever API process hears of its arrival first (holds _lock).
        in_transit = self._metrics.submitted() - self._taken_in
        return in_transit + (self.stats.num_waiting if self.stats else 0)

    def submit(
        self, request_id: str, prompts: list[list[int]], params: SamplingParams
    ) -> RequestStream:
        """Queue one engine request per prompt; 503 if the waiting queue is full."""
        if not self.is_alive:
            raise APIError("The engine is not running.", 503, code="service_unavailable")
        ids = [
            request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))
        ]
        detokenizers = None
        if self._use_process and params.detokenize and not params.stop:
            # Decoded here, not in the engine process: at saturation the engine's host
            # side is the limit and the API processes have cores to spare (vLLM decodes
            # in its front-end too). Stop strings must end a request at the right token,
            # so such requests are still decoded in the engine.
            tokenizer = self.engine.tokenizer
            detokenizers = {
                (rid, i): IncrementalDetokenizer(tokenizer, prompt, params)
                for rid, prompt in zip(ids, prompts, strict=True)
                for i in range(params.n)
            }
            params = dataclasses.replace(params, detokenize=False)
        stream = RequestStream(self, ids, params.n, detokenizers)
        now = time.time()
        with self._lock:
            waiting = self._num_waiting()
            if waiting >= self._max_waiting:
                raise APIError(
                    f"The server is overloaded: {waiting} requests are waiting "
                    f"(limit {self._max_waiting}). Retry later.",
                    503,
                    code="server_overloaded",
                )
            self._submitted += len(prompts)  # before the put: never behind the engine
            self._metrics.set_submitted(self._submitted)
        for rid in ids:
            self._streams[rid] = stream
        self._put([Add(rid, p, params, now) for rid, p in zip(ids, prompts, strict=True)])
        return stream

    def _abort(self, stream: RequestStream) -> None:
        self._metrics.on_abort(stream.unfinished_choices)
        self._forget(stream)

    def _forget(self, stream: RequestStream) -> None:
        """Stop routing to the stream and abort its engine requests (a no-op for finished ones)."""
        for rid in stream.request_ids:
            self._streams.pop(rid, None)
        self._put([Abort(rid) for rid in stream.request_ids])

    def _put(self, items: list[Add | Abort]) -> None:
        if not self._puts:
            self._loop.call_soon(self._flush_puts)
        self._puts += items

    def _flush_puts(self) -> None:
        items, self._puts = self._puts, []
        if items:
            self._backend.put(items)

    def _deliver(self) -> None:
        """Runs on the loop, at its own pace: everything the engine stepped out since the
        last delivery, each stream pushed once (a busy loop gets fewer, fuller wakes)."""
        with self._outbox_lock:
            steps, self._outbox = self._outbox, []
        self._backend.ack()
        per_stream: dict[int, tuple[RequestStream, list[RequestOutput]]] = {}
        streams = self._streams
        for batch, deltas, step_time in steps:
            for rid, item in batch.items():
                stream = streams.get(rid)
                if stream is None:  # aborted by the client meanwhile
                    continue
                if isinstance(item, APIError):
                    # One prompt failed: the client request fails, so its other prompts stop too.
                    per_stream.pop(id(stream), None)
                    stream._push(item)
                    self._forget(stream)
                    continue
                for out in item:
                    stream.last_output[rid, out.index] = out
                self._metrics.on_outputs(item, step_time, stream.last_token_time)
                per_stream.setdefault(id(stream), (stream, []))[1].extend(item)
            for rid, index, token_ids in deltas.entries():
                stream = streams.get(rid)
                if stream is None:
                    continue
                key = rid, index
                out = stream.last_output[key] = follow(stream.last_output[key], token_ids)
                self._metrics.on_outputs([out], step_time, stream.last_token_time)
                per_stream.setdefault(id(stream), (stream, []))[1].append(out)
        for stream, outputs in per_stream.values():
            if stream.finished:  # failed above, in this same delivery
                continue
            stream._push(outputs)
            if stream.finished:
                for rid in stream.request_ids:
                    self._streams.pop(rid, None)

    def _fail_streams(self, error: APIError) -> None:
        """The engine side is gone: every open stream ends with the error."""
        self._stopping = True
        for stream in {id(s): s for s in self._streams.values()}.values():
            stream._push(error)
        self._streams.clear()

    # ------------------------------------------------------------ engine side's threads

    def _run(self, ready: asyncio.Future[None]) -> None:
        """The engine thread (without --engine-process)."""
        assert self._loop is not None and isinstance(self._backend, EngineLoop)
        try:
            self._backend.build()
        except BaseException as exc:  # surfaces in start(): the server does not come up
            self._loop.call_soon_threadsafe(_set_exception, ready, exc)
            return
        self._loop.call_soon_threadsafe(_set_result, ready)
        self._backend.serve()
        self._stopping = True

    def _report_local(
        self, batch: Batch, deltas: TokenDeltas, step_time: float, stats: Any, added: list[str]
    ) -> None:
        """The engine thread's report: it spends the credit that _deliver's ack returns."""
        if batch or deltas:
            self._credit.value = 0  # before the delivery: the ack it brings must win
        self._num_taken_in += len(added)  # the engine thread's own count
        self._report(batch, deltas, step_time, stats, self._num_taken_in)

    def _report(
        self, batch: Batch, deltas: TokenDeltas, step_time: float, stats: Any, taken_in: int
    ) -> None:
        """A step's report, from the engine thread or the engine process's reader:
        its outputs, the engine's stats and how many requests it has taken in, ever."""
        with self._lock:
            self.stats = stats
            self._taken_in = taken_in
        if not batch and not deltas:
            return
        with self._outbox_lock:
            self._outbox.append((batch, deltas, step_time))
            if len(self._outbox) > 1:
                return  # a delivery is already scheduled and will take this too
        # RuntimeError: the loop has closed, so nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._deliver)

    def _engine_exited(self) -> None:
        """The engine process is gone; if it was not asked to stop, it died."""
        if self._stopping or self._loop is None:
            return
        logger.error("the engine process exited unexpectedly")
        error = APIError("The engine process died.", 500)
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._fail_streams, error)


def _set_result(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _set_exception(future: asyncio.Future[None], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
