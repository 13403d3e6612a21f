"""The engine's periodic stats line: arithmetic on a fake clock, and the real line from a server."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import httpx

from engine.stats import EngineStats
from server import engine_loop
from server.app import create_app
from server.config import ServerConfig
from server.engine_loop import StatLog
from tests.server.live_server import LiveServer, engine_config


class FakeEngine:
    def __init__(self) -> None:
        self.runner = SimpleNamespace(
            steps_by_path={"graph": 0, "prefill graph": 0, "eager": 0}, wait_s=0.0
        )
        self.num_sampled = 0

    def get_stats(self) -> EngineStats:
        return EngineStats(256, 12, 0.5, 0, 0, 0)


def test_the_line_splits_steps_by_path_and_time_by_what_the_host_did(monkeypatch, caplog):
    clock = [100.0]
    monkeypatch.setattr(engine_loop.time, "monotonic", lambda: clock[0])
    engine, log = FakeEngine(), StatLog(interval_s=10.0)
    caplog.set_level(logging.INFO, logger="pagoda.server")

    engine.runner.steps_by_path.update({"graph": 3000, "prefill graph": 1000})
    engine.runner.wait_s, engine.num_sampled = 1.0, 400_000
    log.idle(2.0)
    clock[0] = 105.0
    log.maybe_log(engine)
    assert not caplog.records  # not yet an interval

    clock[0] = 110.0
    log.maybe_log(engine)
    [record] = caplog.records
    assert record.getMessage() == (
        "engine: 400 steps/s (graph 75%, prefill graph 25%, eager 0%), 40000 sampled tok/s, "
        "running 256, waiting 12, KV cache 50.0%; host: working 70%, waiting on the device "
        "10%, idle 20%"
    )
    # The next interval counts only its own steps; an interval without steps says nothing.
    engine.runner.steps_by_path["graph"] += 500
    clock[0] = 120.0
    log.maybe_log(engine)
    assert "50 steps/s (graph 100%" in caplog.records[-1].getMessage()
    clock[0] = 130.0
    log.maybe_log(engine)
    assert len(caplog.records) == 2


def test_a_server_under_load_logs_the_line_and_the_flag_silences_it(tiny_gpt2_dir, caplog):
    caplog.set_level(logging.INFO, logger="pagoda.server")
    for interval, expect in ((0.05, True), (0.0, False)):
        caplog.clear()
        config = engine_config(tiny_gpt2_dir, log_stats_interval=interval)
        live = LiveServer(create_app(config, ServerConfig())).start()
        body = {"prompt": "Hi", "max_tokens": 200, "ignore_eos": True}
        try:
            r = httpx.post(f"{live.base_url}/v1/completions", json=body, timeout=60)
        finally:
            live.stop()
        assert r.is_success
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine: ")]
        assert bool(lines) == expect
        if expect:  # the CPU runs every step eagerly
            assert "(graph 0%, prefill graph 0%, eager 100%)" in lines[0]
