"""AsyncEngine: the bridge between the event loop and the engine.

The engine side is an EngineLoop (server/engine_loop.py): by default on a
background thread of this process, with `--engine-process` in a process of its
own (server/engine_process.py), which with `--api-server-count` several API
processes share (server/api_servers.py). Either way, steps' reports go into an outbox;
one `call_soon_threadsafe` delivers all that has gathered when the loop gets
to it, sorting them into per-request `RequestStream`s (which decode the ids into
text and match stop strings: server/request_stream.py), so a busy loop is not
woken once per step, and each delivery acks the engine side, which builds
outputs only when acked. The event loop never touches the engine and never
waits on the device.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import importlib
import logging
import sys
import threading
import time
import uuid
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer, byte_table
from engine.request import RequestOutput, follow
from engine.sampling_params import SamplingParams
from server.config import ServerConfig
from server.engine_loop import (
    Abort,
    Add,
    EngineFactory,
    EngineLoop,
    Flag,
    Item,
    LoRAUpdate,
    StepReport,
    Sync,
)
from server.engine_process import GIL_SWITCH_INTERVAL_S, EngineProcess, spawn_engine
from server.engine_wire import EngineEndpoint, EngineInfo
from server.errors import APIError
from server.metrics import Metrics
from server.request_stream import RequestStream

if TYPE_CHECKING:
    from engine.engine import Engine
    from engine.images import ImageInputs
    from engine.stats import EngineStats

logger = logging.getLogger("pagoda.server")


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig,
        server_config: ServerConfig,
        metrics: Metrics,
        engine_factory: EngineFactory,
        engine_endpoint: EngineEndpoint | None = None,
    ) -> None:
        self._config = config
        self._metrics = metrics
        self._max_waiting = server_config.max_waiting_requests
        self._factory = engine_factory
        # With an endpoint, the engine process is someone else's and already started.
        self._use_process = server_config.engine_process or engine_endpoint is not None
        self._endpoint = engine_endpoint
        self._credit = Flag()  # the engine thread's (an engine process keeps its own)
        self._backend: EngineLoop | EngineProcess | None = None
        self._thread: threading.Thread | None = None  # the engine thread (not with a process)
        self._lock = threading.Lock()  # stats, _taken_in and _submitted
        self._submitted = 0  # engine requests this process has submitted, ever
        # How many requests the engine had taken in (from every API process) when it
        # made self.stats: the two come in one report, so they always agree.
        self._taken_in = 0
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # engine request id -> stream (loop side)
        # Steps' outputs waiting for the loop; a delivery is scheduled iff it is non-empty.
        self._outbox: list[StepReport] = []
        self._outbox_lock = threading.Lock()
        # Adds and aborts of this loop iteration, handed over in one put (one pipe
        # write with --engine-process) instead of one per request.
        self._puts: list[Item] = []
        # LoRAUpdates and Syncs sent, by id: each resolved by the report that answers it.
        self._answers: dict[str, asyncio.Future[None]] = {}
        self.stats: EngineStats | None = None  # the engine's latest
        self.info: EngineInfo | None = None  # once the engine is built
        metrics.watch_engine(self)

    # ------------------------------------------------------------ loop side

    async def start(self) -> None:
        """Build the engine (on its thread or in its process); wait until it is ready."""
        self._loop = asyncio.get_running_loop()
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        # The API side's tokenizer and its byte table are made while the engine builds
        # (the demo model's directory is known only once the engine has written it).
        model = self._config.model
        if model and not self._use_process:
            # Two threads are about to import transformers, which puts a lazy module in
            # place of its own only at the end of its import: a thread importing it
            # meanwhile can find names missing ("cannot import name 'AutoConfig'", seen
            # on a cold start). The package first, then both.
            await asyncio.to_thread(importlib.import_module, "transformers")
        tokenizer = (
            asyncio.ensure_future(asyncio.to_thread(_prepare_tokenizer, model)) if model else None
        )
        try:
            if self._use_process:
                process, endpoint = None, self._endpoint
                if endpoint is None:  # an engine process of our own
                    process, (endpoint,) = spawn_engine(self._config, self._factory)
                self._backend = EngineProcess(endpoint, process, self._report, self._engine_exited)
                info = await self._backend.start()
            else:
                built: concurrent.futures.Future[Engine] = concurrent.futures.Future()
                self._backend = EngineLoop(
                    self._config, self._factory, self._report_local, self._credit
                )
                self._thread = threading.Thread(
                    target=self._run, args=(built,), name="pagoda-engine", daemon=True
                )
                self._thread.start()
                info = EngineInfo.of(await asyncio.wrap_future(built))
        except BaseException:
            if tokenizer is not None:
                tokenizer.cancel()
            raise
        info.tokenizer = await (tokenizer or asyncio.to_thread(_prepare_tokenizer, info.model_dir))
        self.info = info

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
        return self._thread is not None and self._thread.is_alive() and not self._backend.failed

    @property
    def num_waiting(self) -> int:
        """Waiting in the engine, or on the way there from any API process."""
        # Every process's submissions, less those the engine had taken in by its
        # stats snapshot, plus those it counted waiting in it: a request is counted
        # once, whichever API process hears of its arrival first.
        with self._lock:
            in_transit = self._metrics.submitted() - self._taken_in
            return in_transit + (self.stats.num_waiting if self.stats else 0)

    def check_capacity(self) -> None:
        """The 503 a request would get at submit, decided before any work on it (its
        tokenization): under a flood, rejects cost nothing."""
        waiting, limit = self.num_waiting, self._max_waiting
        if waiting >= limit:  # clients that honour Retry-After back off
            raise APIError(
                f"The server is overloaded: {waiting} requests are waiting (limit {limit}). "
                "Retry later.",
                503,
                code="server_overloaded",
                headers={"Retry-After": "1"},
            )

    def submit(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        images: ImageInputs | None = None,
    ) -> RequestStream:
        """Queue one engine request per prompt (images: in every prompt: a chat's, or
        its beams' in a beam search); 503 if the waiting queue is full."""
        if not self.is_alive:
            raise APIError("The engine is not running.", 503, code="service_unavailable")
        ids = [
            request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))
        ]
        # Text and stop strings are the stream's (server/request_stream.py): the engine
        # sends ids only.
        tokenizer = self.info.tokenizer
        decoders = {
            (rid, i): IncrementalDetokenizer(tokenizer, prompt, params)
            for rid, prompt in zip(ids, prompts, strict=True)
            for i in range(params.n)
        }
        stream = RequestStream(ids, params.n, decoders, bool(params.stop), self._abort)
        params = dataclasses.replace(params, detokenize=False, stop=[])
        now = time.time()
        self.check_capacity()  # again: the queue may have filled while the prompt was tokenized
        with self._lock:
            self._submitted += len(prompts)  # before the put: never behind the engine
            self._metrics.set_submitted(self._submitted)
        self._metrics.on_submit(params.n, params.max_tokens)
        for rid in ids:
            self._streams[rid] = stream
        self._put([Add(rid, p, params, now, images) for rid, p in zip(ids, prompts, strict=True)])
        return stream

    async def update_lora(self, name: str, path: str | None, replace: bool = False) -> None:
        """Load the adapter at path as `name` (replace: over a loaded one), or unload it
        (path None), between two engine steps; the engine's refusal as an APIError."""
        if not self.is_alive:
            raise APIError("The engine is not running.", 503, code="service_unavailable")
        request_id = f"lora-{uuid.uuid4().hex}"
        await self._answered(request_id, LoRAUpdate(request_id, name, path, replace))

    async def sync(self) -> None:
        """Return once this process has taken in every report the engine made before now
        (self.stats is at least as new as any other API process's was then)."""
        if not self.is_alive:
            raise APIError("The engine is not running.", 503, code="service_unavailable")
        request_id = f"sync-{uuid.uuid4().hex}"
        await self._answered(request_id, Sync(request_id))

    async def _answered(self, request_id: str, item: LoRAUpdate | Sync) -> None:
        answer = self._answers[request_id] = self._loop.create_future()
        self._put([item])
        try:
            await answer
        finally:
            del self._answers[request_id]

    def _abort(self, stream: RequestStream) -> None:
        self._metrics.on_abort(len(stream.unfinished))
        self._forget(stream)

    def _forget(self, stream: RequestStream) -> None:
        """Stop routing to the stream and abort its engine requests (a no-op for finished ones)."""
        for rid in stream.request_ids:
            self._streams.pop(rid, None)
        self._put([Abort(rid) for rid in stream.request_ids])

    def _put(self, items: list[Item]) -> None:
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
        on_outputs = self._metrics.on_outputs
        for report in steps:
            step_time = report.step_time
            num_tokens = 0
            for rid, item in report.batch.items():
                stream = streams.get(rid)
                if stream is None:  # aborted by the client meanwhile, or a refused LoRAUpdate
                    self._answer(rid, item)
                    continue
                if isinstance(item, APIError):
                    # One prompt failed: the client request fails, so its other prompts stop too.
                    per_stream.pop(id(stream), None)
                    stream.push(item)
                    self._forget(stream)
                    continue
                for out in item:
                    stream.last_output[rid, out.index] = out
                decoded = stream.decode(item)
                num_tokens += on_outputs(decoded, step_time, stream.last_token_time)
                per_stream.setdefault(id(stream), (stream, []))[1].extend(decoded)
            for rid, index, token_ids in report.deltas.entries():
                stream = streams.get(rid)
                if stream is None:
                    continue
                key = rid, index
                out = stream.last_output[key] = follow(stream.last_output[key], token_ids)
                decoded = stream.decode([out])
                num_tokens += on_outputs(decoded, step_time, stream.last_token_time)
                per_stream.setdefault(id(stream), (stream, []))[1].extend(decoded)
            for rid in report.done:
                self._answer(rid, None)
            self._metrics.on_step(num_tokens)
        for stream, outputs in per_stream.values():
            if stream.finished:  # failed above, in this same delivery
                continue
            stream.push(outputs)
            if stream.to_abort:  # over by a stop string: the engine need not go on
                self._put([Abort(rid) for rid in stream.to_abort])
                stream.to_abort.clear()
            if stream.finished:
                for rid in stream.request_ids:
                    self._streams.pop(rid, None)

    def _answer(self, request_id: str, error: object) -> None:
        answer = self._answers.get(request_id)
        if answer is None or answer.done():  # another API process's, or its caller left
            return
        if isinstance(error, APIError):
            answer.set_exception(error)
        else:
            answer.set_result(None)

    def fail_streams(self, error: APIError) -> None:
        """Every open stream ends with the error (the engine side is gone, or the
        server's shutdown grace is over)."""
        self._stopping = True
        for stream in {id(s): s for s in self._streams.values()}.values():
            stream.push(error)
        self._streams.clear()
        for answer in self._answers.values():
            if not answer.done():
                answer.set_exception(error)

    # ------------------------------------------------------------ engine side's threads

    def _run(self, built: concurrent.futures.Future[Engine]) -> None:
        """The engine thread (without --engine-process)."""
        assert isinstance(self._backend, EngineLoop)
        if not built.set_running_or_notify_cancel():  # start() was cancelled
            return
        try:
            built.set_result(self._backend.build())
        except BaseException as exc:  # surfaces in start(): the server does not come up
            built.set_exception(exc)
            return
        self._backend.serve()
        self._stopping = True

    def _report_local(self, report: StepReport) -> None:
        """The engine thread's report: it spends the credit that _deliver's ack returns."""
        if report.has_news:
            self._credit.value = 0  # before the delivery: the ack it brings must win
        self._report(report)

    def _report(self, report: StepReport) -> None:
        """A step's report, from the engine thread or the engine process's reader."""
        with self._lock:
            self.stats = report.stats
            self._taken_in = report.taken_in
        if not report.has_news:
            return
        with self._outbox_lock:
            self._outbox.append(report)
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
            self._loop.call_soon_threadsafe(self.fail_streams, error)


def _prepare_tokenizer(model_dir: str):
    """The API side's tokenizer, its byte table built (once, before a request). Not
    engine.models.loader's: that module brings the model code (torch, Triton) into a
    process that never runs it. The engine loads the same directory's tokenizer, and
    its clear errors are the ones reported (start() awaits the engine before this)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    byte_table(tokenizer)
    return tokenizer
