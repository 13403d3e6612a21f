"""--api-server-count: several API processes, one engine process. Two API processes'
streams from one engine process; leaving fails only its own requests; the supervisor
shares one port, merges /metrics and stops every process on SIGTERM. (How the engine
process routes outputs to them: test_api_clients.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import re
import signal
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from clients.connections import Connections
from engine.sampling_params import SamplingParams
from server.api_servers import bind_sockets
from server.app import build_engine
from server.async_engine import AsyncEngine
from server.config import ServerConfig
from server.engine_process import spawn_engine
from server.errors import APIError
from server.metrics import Metrics, MetricsShare
from tests.server.live_server import MAX_MODEL_LEN, ServerProcess, engine_config
from tests.server.test_concurrency import assert_streams_match, greedy_stream_bodies, stream_text


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
