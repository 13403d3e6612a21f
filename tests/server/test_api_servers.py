"""--api-server-count: several API processes, one engine process. Each API
process gets only its own requests' outputs and the stats; leaving fails only
its own requests; the supervisor shares one port and merges /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import pickle
import re
import signal
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from clients.connections import Connections
from engine.config import EngineConfig
from engine.request import RequestMetrics, RequestOutput, TokenDeltas, TokenLogprob
from engine.sampling_params import SamplingParams
from server.api_servers import bind_sockets
from server.app import build_engine
from server.async_engine import AsyncEngine
from server.config import ServerConfig
from server.engine_loop import Abort, Add, StepReport
from server.engine_process import Clients, spawn_engine
from server.engine_wire import EngineInfo, WireReport
from server.errors import APIError
from server.metrics import Metrics, MetricsShare
from tests.server.live_server import MAX_MODEL_LEN, ServerProcess, engine_config
from tests.server.test_concurrency import assert_streams_match, greedy_stream_bodies, stream_text


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


async def collect(stream) -> tuple[list[int], str | None, APIError | None]:
    ids: list[int] = []
    reason = None
    try:
        async for outputs in stream:
            for out in outputs:
                ids += out.new_token_ids
                reason = out.finish_reason or reason
    except APIError as exc:
        return ids, reason, exc
    return ids, reason, None


async def test_two_api_processes_share_one_engine_process(tiny_gpt2_dir):
    config = engine_config(tiny_gpt2_dir)
    process, endpoints = spawn_engine(config, build_engine, num_clients=2)
    buffer = multiprocessing.get_context("spawn").RawArray("d", 2 * Metrics.num_slots())
    engines = [
        AsyncEngine(config, ServerConfig(), Metrics(MetricsShare(buffer, i, 2)), build_engine,
                    endpoint)
        for i, endpoint in enumerate(endpoints)
    ]  # fmt: skip
    await asyncio.gather(*(e.start() for e in engines))
    try:
        prompts = [[5 + i, 17, 42 + i] for i in range(6)]
        streams = [
            engine.submit(
                f"r{k}-{i}",
                [prompt],
                SamplingParams(max_tokens=5 + i, temperature=0.0, ignore_eos=True),
            )
            for k, engine in enumerate(engines)
            for i, prompt in enumerate(prompts)
        ]
        results = await asyncio.gather(*(collect(s) for s in streams))
        first, second = results[: len(prompts)], results[len(prompts) :]
        for i, ((ids_a, reason_a, err_a), (ids_b, _, err_b)) in enumerate(zip(first, second)):
            assert err_a is None and err_b is None
            assert len(ids_a) == 5 + i and reason_a == "length"
            assert ids_a == ids_b  # the same prompt, greedy: the same tokens, whoever asked
        assert all(e.num_waiting == 0 for e in engines)

        # The first API process leaves mid-request: only its request fails (503).
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        leaving = engines[0].submit("leaving", [[7, 8, 9]], long)
        staying = engines[1].submit("staying", [[7, 8, 9]], long)
        await leaving.__anext__()
        await engines[0].shutdown(timeout=30)
        assert (await collect(leaving))[2].status == 503
        ids, reason, error = await collect(staying)
        assert error is None and reason == "length" and len(ids) >= 199
        assert process.is_alive()
    finally:
        for engine in engines:
            await engine.shutdown(timeout=30)
    process.join(30)
    assert process.exitcode == 0  # stopped because the last API process left


# -- the supervisor, end to end -------------------------------------------------------


class Supervisor(ServerProcess):
    def __init__(self, model_dir: str, tmp_path: Path) -> None:
        args = [
            "--model", model_dir, "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN),
            "--num-kv-blocks", "1024", "--max-num-seqs", "64",
            "--api-server-count", "2", "--shutdown-timeout", "5",
        ]  # fmt: skip
        super().__init__(args, tmp_path / "serve.log", own_group=True)

    def pids(self) -> tuple[int, list[int]]:
        """(engine pid, API process pids), from the supervisor's log."""
        m = re.search(
            r"API processes \(pids \[([\d, ]+)\]\), engine pid (\d+)", self.log.read_text()
        )
        assert m, self.log.read_text()
        return int(m.group(2)), [int(p) for p in m.group(1).split(", ")]

    def metric(self, sample: str) -> float:
        # A new connection each time: any of the API processes may answer.
        text = httpx.get(f"{self.base_url}/metrics", headers={"Connection": "close"}).text
        line = next(line for line in text.splitlines() if line.startswith(sample + " "))
        return float(line.rsplit(" ", 1)[1])


def alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture(scope="module")
def supervisor(tiny_gpt2_dir, tmp_path_factory):
    sup = Supervisor(tiny_gpt2_dir, tmp_path_factory.mktemp("api-servers"))
    try:
        sup.wait_ready()
        yield sup
    finally:
        sup.close()


async def test_streams_from_either_api_process_match_the_thread_engine(supervisor, live):
    bodies = greedy_stream_bodies("Process", 16, 8)

    # Separate clients, so the connections spread over the API processes.
    async def one(body: dict) -> tuple[str, dict]:
        async with httpx.AsyncClient(base_url=supervisor.base_url, timeout=120) as client:
            return await stream_text(client, body)

    streamed = await asyncio.gather(*(one(b) for b in bodies))
    assert_streams_match(live.base_url, bodies, streamed)
    # Every API process's /metrics counts every request.
    total = sum(8 + i for i in range(16))
    for _ in range(6):
        assert supervisor.metric('pagoda:request_success_total{finished_reason="length"}') == 16
        assert supervisor.metric("pagoda:generation_tokens_total") == total
        assert supervisor.metric("pagoda:num_requests_waiting") == 0


def test_embeddings_from_the_api_processes(supervisor, live):
    """Each API process knows the embedding's length (dimensions is checked there)."""
    body = {"input": "an embedding", "encoding_format": "float"}
    want = httpx.post(f"{live.base_url}/v1/embeddings", json=body, timeout=60).json()
    width = len(want["data"][0]["embedding"])
    for _ in range(4):  # new connections: spread over the processes
        got = httpx.post(f"{supervisor.base_url}/v1/embeddings", json=body, timeout=60).json()
        assert got["data"] == want["data"]
        too_wide = body | {"dimensions": width + 1}
        r = httpx.post(f"{supervisor.base_url}/v1/embeddings", json=too_wide, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"


def test_each_api_process_listens_on_a_socket_of_its_own():
    """N sockets on one port (SO_REUSEPORT): the kernel spreads connections over them
    by address, whichever process is in accept() when they come."""
    socks = bind_sockets(ServerConfig(host="127.0.0.1", port=0), 4)
    conns: list[socket.socket] = []
    try:
        port = socks[0].getsockname()[1]
        assert len({s.fileno() for s in socks}) == 4
        assert all(s.getsockname()[1] == port for s in socks)
        conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(256)]
        counts = []
        for sock in socks:  # each connection waits in the accept queue of one of them
            sock.setblocking(False)
            n = 0
            with contextlib.suppress(BlockingIOError):
                while True:
                    accepted, _ = sock.accept()
                    accepted.close()
                    n += 1
            counts.append(n)
        assert sum(counts) == 256
        assert min(counts) >= 32, counts  # 64 each on average; under 32 is ~1e-6
    finally:
        for s in conns + socks:
            s.close()


def established(pids: list[int], port: int) -> dict[int, int]:
    """Established TCP connections to `port` that each process holds (read from /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "01" and int(local.rsplit(":", 1)[1], 16) == port:
                inodes.add(inode)
    counts = {}
    for pid in pids:
        links = []
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                links.append(os.readlink(fd))
        counts[pid] = sum(link[len("socket:[") : -1] in inodes for link in links)
    return counts


async def test_kept_connections_spread_over_the_api_processes(supervisor):
    """Each API process accepts from a socket of its own on the port (SO_REUSEPORT), so
    the kernel spreads connections evenly. From one shared socket, a burst of them
    went mostly to one process, and a client that keeps its connections stayed there."""
    _, servers = supervisor.pids()
    args = SimpleNamespace(base_url=supervisor.base_url, api_key=None, timeout=60.0)
    async with Connections(args) as connections:
        await connections.open(64)
        counts = established(servers, supervisor.port)
    assert sum(counts.values()) >= 64
    assert min(counts.values()) >= 16, counts  # even by hash: fewer than 16 of 64 ~ 1e-4


def test_sigterm_stops_every_process(supervisor):
    engine, servers = supervisor.pids()
    assert all(alive(pid) for pid in [engine, *servers])
    assert supervisor.stop(signal.SIGTERM) == 0
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in [engine, *servers]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in [engine, *servers])


def test_sigterm_to_the_whole_group_lets_streams_finish(tiny_gpt2_dir, tmp_path):
    # As systemd stops a service: every process gets SIGTERM at once. The engine
    # must outlive the API processes' drain, not cut the streams it feeds.
    sup = Supervisor(tiny_gpt2_dir, tmp_path)
    try:
        sup.wait_ready()
        # Short enough to finish in the 5 s grace on a busy machine (past it, the stream
        # would end with an error event: tests/server/test_shutdown.py).
        body = {"prompt": "Hi", "max_tokens": 40, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{sup.base_url}/v1/completions", json=body, timeout=60) as r:
            events = (line for line in r.iter_lines() if line.startswith("data: "))
            chunks = [next(events)]
            os.killpg(sup.proc.pid, signal.SIGTERM)
            chunks += list(events)
        assert chunks[-1] == "data: [DONE]"
        last = json.loads(chunks[-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == "length"
        assert sup.proc.wait(60) == 0
        assert "exited unexpectedly" not in sup.log.read_text()
    finally:
        sup.close()


def test_a_dead_engine_stops_the_supervisor(tiny_gpt2_dir, tmp_path):
    sup = Supervisor(tiny_gpt2_dir, tmp_path)
    try:
        sup.wait_ready()
        engine, servers = sup.pids()
        os.kill(engine, signal.SIGKILL)
        assert sup.proc.wait(60) == 1
        assert "pagoda-engine exited unexpectedly" in sup.log.read_text()
        assert not any(alive(pid) for pid in servers)
    finally:
        sup.close()
