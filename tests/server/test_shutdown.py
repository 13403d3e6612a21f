"""SIGTERM in every layout: streams still open when the grace period ends get an
error event and [DONE] (never a cut connection), and the server exits 0."""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest

from tests.server.live_server import MAX_MODEL_LEN, ServerProcess


def start(model_dir: str, tmp_path, layout: list[str]) -> ServerProcess:
    """`python -m server` in a process group of its own, in the given layout."""
    args = [
        "--model", model_dir, "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN),
        "--num-kv-blocks", "64", "--shutdown-timeout", "0", *layout,
    ]  # fmt: skip
    return ServerProcess(args, tmp_path / "serve.log", own_group=True)


@pytest.mark.parametrize(
    "layout",
    [[], ["--engine-process"], ["--api-server-count", "2"]],
    ids=["thread", "engine process", "api servers"],
)
def test_sigterm_ends_open_streams_with_an_error_event_and_exits_0(tiny_gpt2_dir, tmp_path, layout):
    server = start(tiny_gpt2_dir, tmp_path, layout)
    try:
        server.wait_ready()
        body = {"prompt": "Hi", "max_tokens": 240, "ignore_eos": True, "stream": True}
        url = f"{server.base_url}/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            events = (line for line in r.iter_lines() if line.startswith("data: "))
            chunks = [next(events)]
            os.killpg(server.proc.pid, signal.SIGTERM)  # as systemd stops a service
            chunks += list(events)
        assert chunks[-1] == "data: [DONE]"
        error = json.loads(chunks[-2].removeprefix("data: "))["error"]
        assert "shutting down" in error["message"] and error["type"] == "server_error"
        assert server.proc.wait(60) == 0, server.log.read_text()[-3000:]
    finally:
        server.close()
