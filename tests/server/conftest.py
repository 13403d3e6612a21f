"""A live Pagoda server in-process: uvicorn in a thread on a free 127.0.0.1 port.

Engine settings for the shared server: the tiny GPT-2 on CPU, max_model_len 256,
and enough KV blocks (1024 × 16 tokens) for 64 full-length streams at once.
"""

from __future__ import annotations

import dataclasses
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine.config import EngineConfig
from server.app import create_app
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


@pytest.fixture(scope="session")
def start_server(tiny_gpt2_dir) -> Iterator[Callable[..., LiveServer]]:
    """Factory: start a server with engine/server overrides; all stop at session end."""
    started: list[LiveServer] = []

    def start(
        engine: dict | None = None, server: dict | None = None, engine_factory: Any = None
    ) -> LiveServer:
        server_config = ServerConfig(**({"shutdown_timeout": 5.0} | (server or {})))
        app = create_app(
            engine_config(tiny_gpt2_dir, **(engine or {})),
            server_config,
            engine_factory=engine_factory,
        )
        live = LiveServer(app, server_config).start()
        started.append(live)
        return live

    yield start
    for live in started:
        live.stop()


@pytest.fixture(scope="session")
def lora_server(tiny_llama_dir, tiny_lora_adapters) -> Iterator[LiveServer]:
    """The tiny Llama with the two tiny LoRA adapters (tests/conftest.py, built by tests/tiny_checkpoints.py), and a slot for
    a third to load while serving."""
    config = engine_config(
        tiny_llama_dir, lora_modules=tiny_lora_adapters, enable_lora=True, max_loras=3
    )
    server_config = ServerConfig(shutdown_timeout=5.0, allow_runtime_lora_updating=True)
    live = LiveServer(create_app(config, server_config), server_config).start()
    yield live
    live.stop()


@pytest.fixture(scope="session")
def live(start_server) -> LiveServer:
    return start_server()


@pytest.fixture
def client(live: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.base_url, timeout=60) as c:
        yield c


@pytest.fixture
def oai(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def model_name(tiny_gpt2_dir) -> str:
    return tiny_gpt2_dir.rstrip("/").rsplit("/", 1)[-1]
