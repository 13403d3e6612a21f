"""The server tests' shared servers (tests/server/live_server.py has what they are made of),
and the image tests' tiny LLaVA and image host (tests/server/tiny_llava.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from server.app import create_app
from server.config import ServerConfig
from tests.server.live_server import LiveServer, engine_config
from tests.server.tiny_llava import build_llava, serve_images


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


@pytest.fixture(scope="module")
def llava(tmp_path_factory, tokenizer):
    """The image tests' tiny LLaVA (tests/server/tiny_llava.py), one per test module."""
    return build_llava(tmp_path_factory.mktemp("llava"), tokenizer)


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    """An http host of the image tests' PNGs (tiny_llava.serve_images): its base URL."""
    with serve_images() as url:
        yield url
