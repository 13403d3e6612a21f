"""A live Pagoda server for the server tests: in-process (uvicorn in a thread on a free
127.0.0.1 port) or as `python -m server` in a process of its own, and the engine
settings of the shared one: the tiny GPT-2 on CPU, max_model_len 256, and enough KV
blocks (1024 x 16 tokens) for 64 full-length streams at once.
"""

from __future__ import annotations

import dataclasses
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from engine.config import EngineConfig
from server.config import ServerConfig
from server.http_server import DrainingServer
from tests.ports import free_port

MAX_MODEL_LEN = 256
ROOT = Path(__file__).resolve().parents[2]


class LiveServer:
    def __init__(self, app: Any, server_config: ServerConfig | None = None) -> None:
        self.app = app
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        server_config = server_config or ServerConfig(shutdown_timeout=5.0)
        self.server = DrainingServer(app, dataclasses.replace(server_config, log_level="warning"))
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def start(self, timeout: float = 60.0) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)
        self._sock.close()

    def metric(self, sample: str, default: float | None = None) -> float:
        """One sample from /metrics, named with its labels: `name{label="value"}`."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(sample + " "):
                return float(line.rsplit(" ", 1)[1])
        if default is not None:
            return default
        raise KeyError(sample)


class ServerProcess:
    """`python -m server ARGS --port P` on a free port, output to `log`; with
    `own_group`, in a process group (and session) of its own, which a test may signal.
    A session of its own is also a scheduler autogroup of its own, so it shares the
    CPU with the test differently: a test that needs preemptions under load keeps it off."""

    def __init__(self, args: list[str], log: Path, own_group: bool = False) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "server", *args, "--port", str(self.port)],
                cwd=ROOT,
                stdout=out,
                stderr=out,
                start_new_session=own_group,
            )

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError("the server did not come up:\n" + self.log.read_text())

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def close(self) -> None:
        """After a test, pass or fail: SIGTERM first, so no child process outlives it."""
        try:
            self.stop(signal.SIGTERM, timeout=30)
        except subprocess.TimeoutExpired:
            self.stop(signal.SIGKILL)


def engine_config(model_dir: str, **overrides: Any) -> EngineConfig:
    settings = dict(
        model=model_dir,
        device="cpu",
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=1024,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
    )
    return EngineConfig(**(settings | overrides))
