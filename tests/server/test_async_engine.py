"""The engine thread: a failing step costs only its requests; shutdown stops it cleanly."""

from __future__ import annotations

import gc
import json
import threading

import httpx
import pytest

from engine.engine import Engine
from server.app import create_app
from server.config import ServerConfig
from tests.introspection import is_frozen
from tests.server.live_server import LiveServer, engine_config


class FlakyEngine(Engine):
    """Raises from step() when told to, once."""

    fail_next_step = threading.Event()

    def step(self, emit: bool = True, deltas=None):
        if self.fail_next_step.is_set():
            self.fail_next_step.clear()
            raise RuntimeError("injected fault")
        return super().step(emit, deltas)


@pytest.fixture(scope="module")
def flaky(start_server):
    return start_server(engine_factory=FlakyEngine)


def test_step_failure_is_a_500_and_the_server_keeps_serving(flaky):
    FlakyEngine.fail_next_step.set()
    r = httpx.post(f"{flaky.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4})
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["type"] == "server_error"
    assert "injected fault" not in error["message"]  # internal text stays in the log
    r = httpx.post(f"{flaky.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4})
    assert r.status_code == 200
    assert flaky.metric("pagoda:num_requests_running") == 0
    assert flaky.metric("pagoda:kv_cache_usage_perc") == 0


def test_step_failure_midstream_is_an_error_event_then_done(flaky):
    body = {"prompt": "Hi", "max_tokens": 50, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", f"{flaky.base_url}/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                if len(events) == 2:
                    FlakyEngine.fail_next_step.set()
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "server_error"
    assert len(events) < 50
    assert httpx.get(f"{flaky.base_url}/health").status_code == 200


def test_shutdown_ends_streams_with_an_error_event_and_stops_the_thread(tiny_gpt2_dir):
    config = ServerConfig(shutdown_timeout=0.1)
    app = create_app(engine_config(tiny_gpt2_dir), config)
    live = LiveServer(app, config).start()
    async_engine = app.state.async_engine
    body = {"prompt": "Hi", "max_tokens": 240, "ignore_eos": True, "stream": True}
    stopper = threading.Thread(target=live.stop)
    events = []
    with httpx.stream("POST", f"{live.base_url}/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                if len(events) == 2:
                    stopper.start()  # like SIGTERM: uvicorn drains, then the lifespan ends
    stopper.join(timeout=30)
    # Past the grace period the stream is not cut: it ends with an error, then [DONE].
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "shutting down" in error["message"]
    assert len(events) < 240
    assert not async_engine.is_alive
    assert not async_engine._backend.engine.has_unfinished_requests()
    assert async_engine._backend.engine.get_stats().kv_cache_usage == 0


def test_startup_keeps_the_collector_off_the_engine_and_the_app(tiny_gpt2_dir):
    gc.unfreeze()
    app = create_app(engine_config(tiny_gpt2_dir), ServerConfig())
    live = LiveServer(app).start()
    try:
        assert is_frozen(app.state.async_engine._backend.engine)  # built on the engine thread
        assert is_frozen(app.state.serving)  # built by the lifespan, after the engine
    finally:
        live.stop()
