"""The engine process's side of its API processes (`--api-server-count`).

The engine remembers which API process added each request and sends each its
own outputs; stats and token deltas go to all (an API process skips the ids it
does not know: one pickling of a step's columns costs the engine less than
splitting them). The credit an API process returns after each delivery is a
shared-memory byte, not a message: it is returned hundreds of times a second,
and a pipe write costs a syscall. The engine builds outputs while every API
process has credit.
"""

from __future__ import annotations

import threading
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from server.engine_loop import Abort, Add, Credit, StepReport
from server.engine_wire import Ready, WireReport
from server.errors import APIError

if TYPE_CHECKING:
    from engine.engine import EngineStats
    from engine.request import RequestOutput
    from server.engine_loop import EngineLoop


class Clients:
    """Who added which request, whose credit is spent, and one outgoing pipe each.
    Reports are sent from the engine thread only; the reader threads record
    ownership and departures."""

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
        changed = report.stats != self._stats or report.taken_in != self._taken_in
        self._stats, self._taken_in = report.stats, report.taken_in
        deltas = WireReport.pack_deltas(report.deltas)
        for i in range(n):
            news = outputs[i] or errors[i] or deltas
            if news or changed or i in leaving:
                if news:
                    self._credits[i].value = 0  # before the report: the ack it brings must win
                wire = WireReport(
                    outputs[i], errors[i], deltas, report.step_time, report.stats, report.taken_in
                )
                self._send(i, wire)
        for client in leaving:
            self._close(client)
        if leaving and not self.num_open:
            loop.stop()

    def _send(self, client: int, message: object) -> None:
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
