"""The engine in a process of its own (`--engine-process`), vLLM's layout.

In one process the event loop and the engine thread take turns holding the
GIL: every SSE chunk the loop writes is time the engine's host work (schedule,
prepare, read, detokenize) does not get, and at large batches the engine alone
needs most of a core. Here the engine runs an EngineLoop in a child process
with its own interpreter; the API server keeps the loop to itself.

The engine process serves one or more API processes (`--api-server-count`),
each over its own two pipes of pickled messages:
  API → engine   ("put", [Add | Abort, ...]), ("stop",)
  engine → API   ("ready", EngineInfo, stats), ("failed", message),
                 ("report", rows, errors, deltas, step_time, stats, taken_in)
where rows are the step's RequestOutputs as tuples of their fields (see
_output_row), errors map a request id to the APIError that ended it, deltas
are the step's TokenDeltas pickled once for all API processes (b"" if none),
and taken_in counts the requests the engine has taken in from all API
processes, ever: with the stats it came with, each API process counts those
still on their way (AsyncEngine.num_waiting) without counting one twice.
A reader thread on each side turns messages into calls. The engine remembers
which API process added each request and sends each its own outputs; stats and
token deltas go to all (an API process skips the ids it does not know: one
pickling of a step's columns costs the engine less than splitting them). The
credit an API process returns after each delivery is a
shared-memory byte, not a message: it is returned hundreds of times a second,
and a pipe write costs a syscall. The engine builds outputs while every API
process has credit. The child is spawned, never forked: CUDA cannot be
initialised in a forked child.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import operator
import pickle
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

from engine.config import EngineConfig
from engine.request import RequestMetrics, RequestOutput, TokenDeltas, TokenLogprob
from engine.sampling_params import SamplingParams
from server.engine_loop import Abort, Add, Batch, EngineLoop, Report
from server.errors import APIError

logger = logging.getLogger("pagoda.server")


def _positional(cls: type) -> Callable[[Any], tuple]:
    """Pickle a dataclass as its constructor's arguments: no per-object dict of
    field names."""
    fields = operator.attrgetter(*[f.name for f in dataclasses.fields(cls)])
    return lambda obj: (cls, fields(obj))


# The few objects a report carries now and then (on first and last outputs).
for _cls in (RequestMetrics, TokenLogprob):
    ForkingPickler.register(_cls, _positional(_cls))

# The RequestOutputs themselves travel as plain tuples of their fields: one C call
# each to take apart, where a registered reducer is a Python call per object. With
# one output per running choice per step, pickling them was 8% of the engine
# process's time at 512 requests in flight on the H100; the whole report of 256
# outputs costs ~13% less this way (benchmarks/results/host-step-cpu-report.json).
_output_row = operator.attrgetter(*[f.name for f in dataclasses.fields(RequestOutput)])


def unpack_batch(rows: list[tuple], errors: dict[str, APIError]) -> Batch:
    """A report's rows and errors as the Batch the engine loop built."""
    batch: Batch = {}
    for row in rows:  # one per output, in step order
        out = RequestOutput(*row)
        entry = batch.get(out.request_id)
        if entry is None:
            batch[out.request_id] = [out]
        else:
            entry.append(out)
    batch.update(errors)
    return batch


@dataclass
class EngineInfo:
    """What the API process needs of an engine that lives elsewhere."""

    model_name: str
    model_dir: str
    config: EngineConfig  # as the engine resolved it (max_model_len filled in)
    vocab_size: int
    tokenizer: Any = None  # loaded by the API process from model_dir

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        from engine.engine import check_request

        check_request(prompt_token_ids, params, self.config.max_model_len, self.vocab_size)


@dataclass
class EngineEndpoint:
    """One API process's ends of its link to the engine process (picklable, so a
    spawned API process can be handed one)."""

    to_engine: Connection
    from_engine: Connection
    credit: Any  # multiprocessing.RawValue("b"): 1 while this side has taken its reports in


def spawn_engine(
    config: EngineConfig,
    factory: Callable[[EngineConfig], Any],
    switch_interval: float,
    num_clients: int = 1,
) -> tuple[Any, list[EngineEndpoint]]:
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
            switch_interval,
            logger.getEffectiveLevel(),  # a spawned child starts with logging unset
        ),
        name="pagoda-engine",
        daemon=True,
    )
    process.start()
    for conn in inboxes + outboxes:
        conn.close()  # the child's ends: EOF reaches each side when the other goes
    return process, endpoints


class EngineProcess:
    """The API side's handle: start, put, ack, stop, join; reports arrive on a thread.

    Without an endpoint it spawns an engine process of its own; with one, it joins
    an engine process started elsewhere (server/api_servers.py), shared with
    other API processes."""

    def __init__(
        self,
        config: EngineConfig,
        factory: Callable[[EngineConfig], Any],
        report: Report,
        on_exit: Callable[[], None],
        switch_interval: float,
        endpoint: EngineEndpoint | None = None,
    ) -> None:
        self._config = config
        self._factory = factory
        self._report = report
        self._on_exit = on_exit  # the link is gone (stopped, or the engine died); from the reader
        self._switch_interval = switch_interval
        self._endpoint = endpoint
        self._process: Any = None  # only when this side spawned it
        self._reader: threading.Thread | None = None

    async def start(self) -> EngineInfo:
        """Spawn the child (unless shared) and wait until its engine is built (or raise why not)."""
        if self._endpoint is None:
            self._process, (self._endpoint,) = spawn_engine(
                self._config, self._factory, self._switch_interval
            )
        try:
            kind, *rest = await asyncio.to_thread(self._endpoint.from_engine.recv)
        except EOFError:
            raise RuntimeError("the engine process exited while starting") from None
        if kind == "failed":
            raise RuntimeError(f"the engine process failed to start: {rest[0]}")
        info, stats = rest
        self._report({}, TokenDeltas(), 0.0, stats, 0)
        self._reader = threading.Thread(target=self._read, name="pagoda-engine-reader", daemon=True)
        self._reader.start()
        return info

    def _read(self) -> None:
        assert self._endpoint is not None
        try:
            while True:
                _, rows, errors, deltas, step_time, stats, taken_in = (
                    self._endpoint.from_engine.recv()
                )
                batch = unpack_batch(rows, errors)
                columns = TokenDeltas(*pickle.loads(deltas)) if deltas else TokenDeltas()
                self._report(batch, columns, step_time, stats, taken_in)
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

    def put(self, items: list[Add | Abort]) -> None:
        self._send(("put", items))

    def ack(self) -> None:
        self._endpoint.credit.value = 1

    def stop(self) -> None:
        """This side is leaving: the engine fails its open requests (503) and, when
        no API process is left, stops."""
        self._send(("stop",))

    def _send(self, message: tuple) -> None:
        # The child is gone (or never came up): the reader reports that.
        with contextlib.suppress(OSError, AttributeError):
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


class Clients:
    """The engine process's side of its API processes: who added which request,
    whose credit is spent, and one outgoing pipe each. Reports are sent from the
    engine thread only; the reader threads record ownership and departures."""

    def __init__(self, outboxes: list[Connection], credits: list[Any]) -> None:
        self._outboxes: list[Connection | None] = list(outboxes)
        self._credits = credits
        self._lock = threading.Lock()  # _owner and _leaving, shared with the readers
        self._owner: dict[str, int] = {}  # engine request id -> client
        self._aborted: list[str] = []  # ids clients aborted: forgotten at the next report
        self._leaving: set[int] = set()  # said stop (or went away); not yet let go
        self._stats: Any = None
        self._taken_in = 0  # requests the loop has taken from its inbox, ever

    @property
    def value(self) -> int:
        """Credit for the EngineLoop: every client still here has taken its reports in."""
        return int(
            all(c.value for i, c in enumerate(self._credits) if self._outboxes[i] is not None)
        )

    @property
    def num_open(self) -> int:
        return sum(out is not None for out in self._outboxes)

    def send_all(self, message: tuple) -> None:
        for i in range(len(self._outboxes)):
            self._send(i, message)

    def ready(self, info: EngineInfo, stats: Any) -> None:
        self.send_all(("ready", info, stats))
        self._stats = stats

    def own(self, client: int, items: list[Add | Abort]) -> None:
        with self._lock:
            for item in items:
                if isinstance(item, Add):
                    self._owner[item.request_id] = client
                else:  # forgotten only after its add has been counted in a report
                    self._aborted.append(item.request_id)

    def leave(self, client: int) -> list[Abort]:
        """Client is going: the aborts that free its requests' work in the engine."""
        with self._lock:
            self._leaving.add(client)
            return [Abort(rid) for rid, owner in self._owner.items() if owner == client]

    def report(
        self,
        loop: EngineLoop,
        batch: Batch,
        deltas: TokenDeltas,
        step_time: float,
        stats: Any,
        added: list[str],
    ) -> None:
        """Split a step's report by client; let leaving clients go; stop the loop
        when none is left."""
        n = len(self._outboxes)
        rows: list[list[tuple]] = [[] for _ in range(n)]
        errors: list[dict[str, APIError]] = [{} for _ in range(n)]
        active = loop.active
        with self._lock:
            owner = self._owner
            for rid, item in batch.items():
                client = owner.get(rid)
                if client is not None:
                    if isinstance(item, list):
                        rows[client] += map(_output_row, item)
                    else:
                        errors[client][rid] = item
                if rid not in active:
                    owner.pop(rid, None)
            aborted, self._aborted = self._aborted, []
            for rid in aborted:
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
        changed = stats != self._stats or bool(added)
        self._stats = stats
        self._taken_in += len(added)
        columns = b""
        if deltas:
            fields = (deltas.request_ids, deltas.indices, deltas.num_tokens, deltas.token_ids)
            columns = pickle.dumps(fields, pickle.HIGHEST_PROTOCOL)
        for i in range(n):
            news = rows[i] or errors[i] or columns
            if news or changed or i in leaving:
                if news:
                    self._credits[i].value = 0  # before the report: the ack it brings must win
                report = ("report", rows[i], errors[i], columns, step_time, stats, self._taken_in)
                self._send(i, report)
        for client in leaving:
            self._close(client)
        if leaving and not self.num_open:
            loop.stop()

    def _send(self, client: int, message: tuple) -> None:
        out = self._outboxes[client]
        if out is None:
            return
        try:
            out.send(message)
        except OSError:  # its process is gone; its reader thread notices the EOF too
            self._close(client)

    def _close(self, client: int) -> None:
        out, self._outboxes[client] = self._outboxes[client], None
        if out is not None:
            out.close()


def _child_main(
    inboxes: list[Connection],
    outboxes: list[Connection],
    credits: list[Any],
    config: EngineConfig,
    factory: Callable[[EngineConfig], Any],
    switch_interval: float,
    log_level: int,
) -> None:
    logging.basicConfig(
        level=log_level,
        format="%(asctime)s %(levelname)s %(name)s (engine process): %(message)s",
    )
    sys.setswitchinterval(switch_interval)  # the reader must not wait 5 ms to hand over a put
    # Ctrl-C reaches the whole process group, and systemd or `kill -- -PGID` send
    # SIGTERM to it: the API processes drain their streams, which need this one,
    # and then let it go through the pipe.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    clients = Clients(outboxes, credits)
    ready = threading.Event()

    def report(
        batch: Batch, deltas: TokenDeltas, step_time: float, stats: Any, added: list[str]
    ) -> None:
        if ready.is_set():
            clients.report(loop, batch, deltas, step_time, stats, added)

    loop = EngineLoop(config, factory, report, clients)
    try:
        engine = loop.build()
    except BaseException as exc:
        clients.send_all(("failed", f"{type(exc).__name__}: {exc}"))
        return
    info = EngineInfo(engine.model_name, engine.model_dir, engine.config, engine.vocab_size)
    clients.ready(info, engine.get_stats())
    ready.set()

    def read(client: int, inbox: Connection) -> None:
        try:
            while True:
                kind, *rest = inbox.recv()
                if kind == "put":
                    clients.own(client, rest[0])
                    loop.put(rest[0])
                elif kind == "stop":
                    break
        except (EOFError, OSError):
            pass  # the API process is gone: let it go too
        loop.put(clients.leave(client), wake=True)  # wake: the next report lets it go

    for i, inbox in enumerate(inboxes):
        name = f"pagoda-engine-inbox-{i}"
        threading.Thread(target=read, args=(i, inbox), name=name, daemon=True).start()
    loop.serve()
