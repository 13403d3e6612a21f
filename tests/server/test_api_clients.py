"""--api-server-count's routing, in process: the engine process's Clients send each API
process only its own requests' outputs (as rows without field names), every client the
step's token deltas and stats (pickled once), and the API processes share the metrics
and the waiting count, each waiting request counted once."""

from __future__ import annotations

import multiprocessing
import pickle
from types import SimpleNamespace

import pytest

from engine.config import EngineConfig
from engine.request import RequestMetrics, RequestOutput, TokenDeltas, TokenLogprob
from engine.sampling_params import SamplingParams
from server.app import build_engine
from server.async_engine import AsyncEngine
from server.config import ServerConfig
from server.engine_loop import Abort, Add, StepReport
from server.engine_process import Clients
from server.engine_wire import EngineInfo, WireReport
from server.errors import APIError
from server.metrics import Metrics, MetricsShare


class FakeLoop:
    def __init__(self, active: set[str]) -> None:
        self.active = active
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True


def output(rid: str, index: int, ids: list[int], finished: bool = False) -> RequestOutput:
    reason = "length" if finished else None
    return RequestOutput(rid, index, ids, "", None, finished, reason, None, 1, len(ids), 0, None)


def two_clients(owned: list[list[str]]) -> tuple[Clients, list, list]:
    """Clients for two API processes, each owning its request ids; with their pipes
    (reader, writer) and credits."""
    ctx = multiprocessing.get_context("spawn")
    pipes = [multiprocessing.Pipe(duplex=False) for _ in range(2)]
    credits = [ctx.RawValue("b", 1) for _ in range(2)]
    clients = Clients([w for _, w in pipes], credits)
    params = SamplingParams(max_tokens=4)
    for client, ids in enumerate(owned):
        clients.own(client, [Add(rid, [1], params, 0.0) for rid in ids])
    return clients, pipes, credits


def step(batch: dict, stats: str, taken_in: int, deltas: TokenDeltas | None = None) -> StepReport:
    return StepReport(batch, deltas or TokenDeltas(), 1.0, stats, taken_in)


def test_clients_route_outputs_count_adds_and_let_go():
    clients, pipes, credits = two_clients([["a"], ["b", "c"]])
    loop = FakeLoop({"a", "b", "c"})
    a1, b1, b2 = output("a", 0, [7]), output("b", 0, [8]), output("b", 1, [9])
    clients.report(loop, step({"a": [a1], "b": [b1, b2]}, "stats1", 3))
    # Outputs go to their own client; both hear that the engine took in 3 requests.
    assert pipes[0][0].recv() == WireReport([a1], {}, b"", 1.0, "stats1", 3, [])
    assert pipes[1][0].recv() == WireReport([b1, b2], {}, b"", 1.0, "stats1", 3, [])
    assert credits[0].value == 0 and credits[1].value == 0 and clients.value == 0
    credits[0].value = 1
    assert clients.value == 0  # the engine builds outputs only once both took theirs in
    credits[1].value = 1
    assert clients.value == 1

    # Same stats, news for client 1 only: client 0 hears nothing.
    loop.active.discard("b")  # finished: forgotten after this report
    b3 = output("b", 0, [10], finished=True)
    clients.report(loop, step({"b": [b3]}, "stats1", 3))
    assert pipes[1][0].recv() == WireReport([b3], {}, b"", 1.0, "stats1", 3, [])
    assert not pipes[0][0].poll() and credits[0].value == 1

    # Client 1 leaves with "c" still running: "c" is aborted in the engine and
    # fails with a 503 for client 1, whose pipe then closes; client 0 carries on.
    assert clients.leave(1) == [Abort("c")]
    clients.report(loop, step({}, "stats2", 3))
    report = pipes[1][0].recv()
    assert report.outputs == [] and report.errors["c"].status == 503
    with pytest.raises(EOFError):
        pipes[1][0].recv()
    assert pipes[0][0].recv() == WireReport([], {}, b"", 1.0, "stats2", 3, [])  # new stats: to all
    assert clients.num_open == 1 and not loop.stopped
    credits[1].value = 0
    assert clients.value == 1  # a client that left holds nothing back

    clients.own(0, [Abort("a")])  # aborted by its client: forgotten, never routed again
    clients.report(loop, step({"a": [output("a", 0, [11])]}, "stats2", 3))
    assert clients.leave(0) == []
    clients.report(loop, step({}, "stats2", 3))
    assert loop.stopped  # the last one left


def test_outputs_cross_the_pipe_as_rows_without_field_names():
    """A WireReport pickles its outputs as tuples of their fields: no field names, no
    per-output reducer; what arrives equals what was sent."""
    clients, pipes, _ = two_clients([["a"], []])
    loop = FakeLoop({"a"})
    logprob = TokenLogprob(17, -0.25, 1, [(17, -0.25), (3, -2.0)])
    first = RequestOutput(
        "a", 0, [17, 18], "", [logprob], True, "stop", 18, 9, 2, 4,
        RequestMetrics(1.0, 2.0, 3.0, 4.0), [None, logprob],
    )  # fmt: skip
    second = output("a", 1, [5])
    clients.report(loop, step({"a": [first, second]}, "stats", 1))
    wire = pipes[0][0].recv_bytes()
    assert b"new_token_ids" not in wire and b"first_token_time" not in wire
    report = pickle.loads(wire).step_report()
    assert report.batch == {"a": [first, second]} and report.taken_in == 1


def test_clients_send_token_deltas_to_every_client_once_pickled():
    """Outputs that are ids only travel as columns, pickled once for every client (each
    skips the ids it does not know), and spend the credit of each."""
    clients, pipes, credits = two_clients([["a"], ["b"]])
    loop = FakeLoop({"a", "b"})
    clients.report(loop, step({}, "stats", 2))
    assert [pipes[i][0].recv().deltas for i in range(2)] == [b"", b""]  # new stats, no deltas
    assert [c.value for c in credits] == [1, 1]

    deltas = TokenDeltas(["a", "b", "b"], [0, 0, 1], [1, 2, 3], [7, 8, 80, 9, 10, 11])
    clients.report(loop, step({}, "stats", 2, deltas))
    for reader, _ in pipes:
        assert list(reader.recv().step_report().deltas.entries()) == [
            ("a", 0, [7]),
            ("b", 0, [8, 80]),
            ("b", 1, [9, 10, 11]),
        ]
    assert [c.value for c in credits] == [0, 0]


def test_a_steps_shared_part_is_pickled_once_for_every_client(monkeypatch):
    """Deltas and stats go to every API process: pickled once per step, each client's
    message carrying its own outputs beside them."""
    clients, pipes, _ = two_clients([["a"], ["b"]])
    loop = FakeLoop({"a", "b"})
    packed = []
    pack_shared = WireReport.pack_shared
    monkeypatch.setattr(
        WireReport, "pack_shared", staticmethod(lambda *a: packed.append(a) or pack_shared(*a))
    )
    deltas = TokenDeltas(["a", "b"], [0, 0], [1, 1], [7, 8])
    a1 = output("a", 0, [5])
    clients.report(loop, step({"a": [a1]}, "stats", 2, deltas))
    assert len(packed) == 1
    first, second = (pipes[i][0].recv() for i in range(2))
    assert first.outputs == [a1] and second.outputs == []
    assert first.deltas == second.deltas == WireReport.pack_deltas(deltas)
    assert (first.stats, first.taken_in, second.stats, second.taken_in) == ("stats", 2) * 2


def test_metric_rows_sum_across_processes():
    buffer = multiprocessing.get_context("spawn").RawArray("d", 2 * Metrics.num_slots())
    first, second = (Metrics(MetricsShare(buffer, i, 2)) for i in range(2))
    first.itl.observe(0.003)
    second.itl.observe(0.2)
    second.request_success.inc(2, "length")
    first.set_submitted(3)
    second.set_submitted(1)
    for m in (first, second):
        assert m.itl.family().samples[-2].value == 2  # _count
        assert m.request_success.family().samples[0].value == 2
        assert m.submitted() == 4


def test_a_request_is_counted_waiting_once_whichever_api_process_hears_first(
    monkeypatch, tokenizer
):
    """Two API processes share the waiting limit. A request the engine has taken in
    is in the stats of the report that says so; until then, in its process's
    submissions. The process that did not send it may hear first: it must not
    count it in both (it did, and turned requests away below the limit)."""
    monkeypatch.setattr(AsyncEngine, "is_alive", property(lambda self: True))
    buffer = multiprocessing.get_context("spawn").RawArray("d", 2 * Metrics.num_slots())
    limit = ServerConfig(max_waiting_requests=5)
    a, b = (
        AsyncEngine(EngineConfig(), limit, Metrics(MetricsShare(buffer, i, 2)), build_engine)
        for i in range(2)
    )
    sent: list = []
    a._put = b._put = sent.extend  # no engine: the puts just collect
    a.info = b.info = EngineInfo("tiny", "", EngineConfig(), len(tokenizer), tokenizer)

    def report(api: AsyncEngine, waiting: int, taken_in: int) -> None:
        stats = SimpleNamespace(num_waiting=waiting)
        api._report(StepReport({}, TokenDeltas(), 0.0, stats, taken_in))

    for api in (a, b):
        report(api, 0, 0)  # "ready"
    for i in range(3):
        b.submit(f"b{i}", [[1, 2]], SamplingParams(max_tokens=2))
    assert a.num_waiting == b.num_waiting == 3  # on their way
    report(a, 3, 3)  # the engine took them in; a hears it before b
    assert a.num_waiting == b.num_waiting == 3
    report(b, 3, 3)
    assert a.num_waiting == b.num_waiting == 3
    report(a, 1, 3)  # two of them started running
    a.submit("a0", [[1, 2]], SamplingParams(max_tokens=2))
    assert a.num_waiting == 2
    for i in range(1, 4):
        a.submit(f"a{i}", [[1, 2]], SamplingParams(max_tokens=2))
    with pytest.raises(APIError, match="5 requests are waiting") as exc:
        a.submit("a4", [[1, 2]], SamplingParams(max_tokens=2))
    assert exc.value.status == 503 and len(sent) == 7
