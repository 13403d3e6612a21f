"""The engine in a process of its own (`--engine-process`), vLLM's layout.

In one process the event loop and the engine thread take turns holding the
GIL: every SSE chunk the loop writes is time the engine's host work (schedule,
prepare, read) does not get, and at large batches the engine alone needs most
of a core. Here the engine runs an EngineLoop in a child process with its own
interpreter; the API server keeps the loop to itself.

The engine process serves one or more API processes (`--api-server-count`),
each over its own two pipes of messages (server/engine_wire.py); a reader
thread on each side turns messages into calls, and Clients splits each step's
report by API process. The child is spawned: CUDA cannot start in a forked one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.heap import pause_collection
from engine.request import TokenDeltas
from server.engine_loop import (
    Abort,
    Credit,
    EngineFactory,
    EngineLoop,
    Item,
    Listener,
    StepReport,
)
from server.engine_wire import EngineEndpoint, EngineInfo, Failed, Put, Ready, Stop, WireReport
from server.errors import APIError

if TYPE_CHECKING:
    from engine.request import RequestOutput
    from engine.stats import EngineStats

logger = logging.getLogger("pagoda.server")
# A thread that waits for the GIL gets it after this long at most (sys.setswitchinterval,
# on both sides of the engine): by default (5 ms) a busy event loop would stretch every
# decode step, and the engine process's reader would wait as long to hand over a put.
GIL_SWITCH_INTERVAL_S = 1e-4


def spawn_engine(
    config: EngineConfig, factory: EngineFactory, num_clients: int = 1
) -> tuple[BaseProcess, list[EngineEndpoint]]:
    """Start the engine process for `num_clients` API processes; returns it and their
    endpoints. It has not built its engine yet: each endpoint gets "ready" when it has."""
    ctx = multiprocessing.get_context("spawn")
    endpoints, inboxes, outboxes = [], [], []
    for _ in range(num_clients):
        from_engine, outbox = ctx.Pipe(duplex=False)
        inbox, to_engine = ctx.Pipe(duplex=False)
        endpoints.append(EngineEndpoint(to_engine, from_engine, ctx.RawValue("b", 1)))
        inboxes.append(inbox)
        outboxes.append(outbox)
    process = ctx.Process(
        target=_child_main,
        args=(
            inboxes,
            outboxes,
            [e.credit for e in endpoints],
            config,
            factory,
            logger.getEffectiveLevel(),  # a spawned child starts with logging unset
        ),
        name="pagoda-engine",
        # A daemon may not have children: with tensor parallelism it spawns its ranks.
        # It still ends with its API processes (their pipes close; it stops).
        daemon=config.tensor_parallel_size == 1,
    )
    process.start()
    for conn in inboxes + outboxes:
        conn.close()  # the child's ends: EOF reaches each side when the other goes
    return process, endpoints


class EngineProcess:
    """The API side's handle: start, put, ack, stop, join; reports arrive on a thread.

    `process`: the engine process, when this side spawned it (spawn_engine) and so stops
    it; None when it was started elsewhere (server/api_servers.py), shared with other
    API processes."""

    def __init__(
        self,
        endpoint: EngineEndpoint,
        process: BaseProcess | None,
        listener: Listener,
        on_exit: Callable[[], None],
    ) -> None:
        self._endpoint = endpoint
        self._process = process
        self._listener = listener
        self._on_exit = on_exit  # the link is gone (stopped, or the engine died); from the reader
        self._reader: threading.Thread | None = None

    async def start(self) -> EngineInfo:
        """Wait until the engine process has built its engine (or raise why not)."""
        try:
            message = await asyncio.to_thread(self._endpoint.from_engine.recv)
        except EOFError:
            raise RuntimeError("the engine process exited while starting") from None
        if isinstance(message, Failed):
            raise RuntimeError(f"the engine process failed to start: {message.message}")
        assert isinstance(message, Ready)
        self._listener(StepReport({}, TokenDeltas(), 0.0, message.stats, 0))
        self._reader = threading.Thread(target=self._read, name="pagoda-engine-reader", daemon=True)
        self._reader.start()
        return message.info

    def _read(self) -> None:
        try:
            while True:
                report: WireReport = self._endpoint.from_engine.recv()
                self._listener(report.step_report())
        except (EOFError, OSError):
            pass
        except Exception:
            logger.exception("reading from the engine process failed")
        self._on_exit()

    @property
    def is_alive(self) -> bool:
        # A shared engine's death closes the pipe, which ends the reader.
        return (
            (self._process is None or self._process.is_alive())
            and self._reader is not None
            and self._reader.is_alive()
        )

    def put(self, items: list[Item]) -> None:
        self._send(Put(items))

    def ack(self) -> None:
        self._endpoint.credit.value = 1

    def stop(self) -> None:
        """This side is leaving: the engine fails its open requests (503) and, when
        no API process is left, stops."""
        self._send(Stop())

    def _send(self, message: Put | Stop) -> None:
        # The child is gone (or never came up): the reader reports that.
        with contextlib.suppress(OSError):
            self._endpoint.to_engine.send(message)

    def join(self, timeout: float) -> None:
        """Wait until the engine has let this side go (its process too, if it is ours)."""
        if self._reader is not None:
            self._reader.join(timeout)
        if self._process is None:
            return
        self._process.join(timeout)
        if self._process.is_alive():
            logger.warning("the engine process did not stop in %.0f s; killing it", timeout)
            self._process.kill()
            self._process.join()


def _child_main(
    inboxes: list[Connection],
    outboxes: list[Connection],
    credits: list[Credit],
    config: EngineConfig,
    factory: EngineFactory,
    log_level: int,
) -> None:
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s %(name)s (engine process): %(message)s"
    )
    pause_collection()  # until the engine's build freezes the startup heap (engine/heap.py)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    # Ctrl-C reaches the whole process group, and systemd or `kill -- -PGID` send
    # SIGTERM to it: the API processes drain their streams, which need this one,
    # and then let it go through the pipe.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    clients = Clients(outboxes, credits)
    ready = threading.Event()

    def report(step: StepReport) -> None:
        if ready.is_set():
            clients.report(loop, step)

    loop = EngineLoop(config, factory, report, clients)
    try:
        engine = loop.build()
    except BaseException as exc:
        clients.send_all(Failed(f"{type(exc).__name__}: {exc}"))
        return
    clients.ready(Ready(EngineInfo.of(engine), engine.get_stats()))
    ready.set()

    def read(client: int, inbox: Connection) -> None:
        try:
            while True:
                message: Put | Stop = inbox.recv()
                if isinstance(message, Stop):
                    break
                clients.own(client, message.items)
                loop.put(message.items)
        except (EOFError, OSError):
            pass  # the API process is gone: let it go too
        loop.put(clients.leave(client), wake=True)  # wake: the next report lets it go

    for i, inbox in enumerate(inboxes):
        name = f"pagoda-engine-inbox-{i}"
        threading.Thread(target=read, args=(i, inbox), name=name, daemon=True).start()
    loop.serve()


class Clients:
    """The engine process's side of its API processes: who added which request, whose
    credit is spent, and one outgoing pipe each. Reports are sent from the engine
    thread only; the reader threads record ownership and departures.

    Each API process gets its own outputs; stats and token deltas go to all (an API
    process skips the ids it does not know: one pickling of a step's columns costs
    the engine less than splitting them). The credit an API process returns after
    each delivery is a shared-memory byte, not a message: it is returned hundreds of
    times a second, and a pipe write costs a syscall."""

    def __init__(self, outboxes: list[Connection], credits: list[Credit]) -> None:
        self._outboxes: list[Connection | None] = list(outboxes)
        self._credits = credits
        self._lock = threading.Lock()  # _owner and _leaving, shared with the readers
        self._owner: dict[str, int] = {}  # engine request id -> client
        self._aborted: list[str] = []  # ids clients aborted: forgotten at the next report
        self._leaving: set[int] = set()  # said stop (or went away); not yet let go
        self._stats: EngineStats | None = None
        self._taken_in = 0  # as of the last report sent

    @property
    def value(self) -> int:
        """Credit for the EngineLoop: every client still here has taken its reports in."""
        return int(
            all(c.value for i, c in enumerate(self._credits) if self._outboxes[i] is not None)
        )

    @property
    def num_open(self) -> int:
        return sum(out is not None for out in self._outboxes)

    def send_all(self, message: object) -> None:
        for i in range(len(self._outboxes)):
            self._send(i, message)

    def ready(self, ready: Ready) -> None:
        self.send_all(ready)
        self._stats = ready.stats

    def own(self, client: int, items: list[Item]) -> None:
        with self._lock:
            for item in items:
                if isinstance(item, Abort):  # forgotten only after its add has been counted
                    self._aborted.append(item.request_id)
                else:  # an Add, a LoRAUpdate or a Sync, which can come back as an error
                    self._owner[item.request_id] = client

    def leave(self, client: int) -> list[Abort]:
        """Client is going: the aborts that free its requests' work in the engine."""
        with self._lock:
            self._leaving.add(client)
            return [Abort(rid) for rid, owner in self._owner.items() if owner == client]

    def report(self, loop: EngineLoop, report: StepReport) -> None:
        """Split a step's report by client; let leaving clients go; stop the loop
        when none is left."""
        n = len(self._outboxes)
        outputs: list[list[RequestOutput]] = [[] for _ in range(n)]
        errors: list[dict[str, APIError]] = [{} for _ in range(n)]
        active = loop.active
        with self._lock:
            owner = self._owner
            for rid, item in report.batch.items():
                client = owner.get(rid)
                if client is not None:
                    if isinstance(item, list):
                        outputs[client] += item
                    else:
                        errors[client][rid] = item
                if rid not in active:
                    owner.pop(rid, None)
            aborted, self._aborted = self._aborted, []
            for rid in aborted + report.done:
                owner.pop(rid, None)
            leaving, self._leaving = self._leaving, set()
            for client in leaving:  # its requests were aborted in this step's drain
                gone = [rid for rid, c in owner.items() if c == client]
                error = APIError("The server is shutting down.", 503)
                for rid in gone:
                    del owner[rid]
                    errors[client][rid] = error
        # Every API process hears of new stats and of every request taken in (whoever
        # sent it): its admission check counts waiting requests by the two together.
        changed = report.stats != self._stats or report.taken_in != self._taken_in
        self._stats, self._taken_in = report.stats, report.taken_in
        deltas = WireReport.pack_deltas(report.deltas)
        shared = None
        for i in range(n):
            news = outputs[i] or errors[i] or deltas or report.done
            if news or changed or i in leaving:
                if news:
                    self._credits[i].value = 0  # before the report: the ack it brings must win
                if shared is None:
                    shared = WireReport.pack_shared(
                        deltas, report.step_time, report.stats, report.taken_in, report.done
                    )
                self._send(i, WireReport.pack(outputs[i], errors[i], shared))
        for client in leaving:
            self._close(client)
        if leaving and not self.num_open:
            loop.stop()

    def _send(self, client: int, message: object) -> None:
        """message: an object, or bytes already pickled (WireReport.pack)."""
        out = self._outboxes[client]
        if out is None:
            return
        try:
            if isinstance(message, bytes):
                out.send_bytes(message)
            else:
                out.send(message)
        except OSError:  # its process is gone; its reader thread notices the EOF too
            self._close(client)

    def _close(self, client: int) -> None:
        out, self._outboxes[client] = self._outboxes[client], None
        if out is not None:
            out.close()
