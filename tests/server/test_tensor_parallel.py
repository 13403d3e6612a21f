"""Tensor parallelism behind the server, on CPU (gloo): two ranks serve transformers'
greedy tokens; two "nodes" on localhost (node 0 and a --headless node 1) do too;
a rank killed mid-stream stops the engine within seconds and /health turns 503."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch.distributed as dist

from benchmarks.api_cost import descendants
from engine.models.loader import load_tokenizer
from server.app import create_app
from server.config import ServerConfig
from tests.ports import free_port
from tests.reference import PROMPTS, hf_greedy
from tests.server.live_server import ROOT, LiveServer, ServerProcess, engine_config

MAX_NEW = 12
SMALL = dict(num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=64)


def expected_texts(model_dir: str, prompts: list[str]) -> list[str]:
    tokenizer = load_tokenizer(model_dir)
    return [
        # The server skips special tokens in text, as OpenAI's and vLLM's do (EOS here).
        tokenizer.decode(
            hf_greedy(model_dir, tokenizer.encode(p), MAX_NEW), skip_special_tokens=True
        )
        for p in prompts
    ]


def completions(base_url: str, prompts: list[str]) -> list[str]:
    body = {"prompt": prompts, "max_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


@pytest.fixture(scope="module")
def tp_server(tiny_gpt2_dir):
    config = ServerConfig(shutdown_timeout=5.0)
    app = create_app(engine_config(tiny_gpt2_dir, tensor_parallel_size=2, **SMALL), config)
    live = LiveServer(app, config).start(timeout=180)
    yield live
    live.stop()


def test_two_ranks_serve_transformers_greedy_tokens(tp_server, tiny_gpt2_dir):
    prompts = PROMPTS[:4]
    assert completions(tp_server.base_url, prompts) == expected_texts(tiny_gpt2_dir, prompts)


@pytest.fixture(scope="module", params=["llama", "llama_kv3", "qwen2"])
def other_server(request):
    """The other checkpoints behind a server: Llama with GQA (2 kv heads, and 3, which do
    not split over 2 ranks) and Qwen2. In an engine process of its own, so that its rank
    0 does not share this process (and its process group) with tp_server's."""
    model_dir = request.getfixturevalue(f"tiny_{request.param}_dir")
    config = ServerConfig(shutdown_timeout=5.0, engine_process=True)
    app = create_app(engine_config(model_dir, tensor_parallel_size=2, **SMALL), config)
    live = LiveServer(app, config).start(timeout=180)
    yield model_dir, live
    live.stop()


def test_llama_and_qwen2_ranks_serve_transformers_greedy_tokens(other_server):
    model_dir, live = other_server
    prompts = PROMPTS[:4]
    assert completions(live.base_url, prompts) == expected_texts(model_dir, prompts)


def test_a_killed_rank_stops_the_engine_and_health_turns_503(tp_server):
    """The server's engine is gone after this: the module's other tests come first."""
    engine = tp_server.app.state.async_engine._backend.engine
    (worker,) = engine.workers.processes.values()
    body = {"prompt": "Hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
    events: list[str] = []
    killed_at: list[float] = []
    with httpx.stream("POST", f"{tp_server.base_url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                if len(events) == 2:
                    os.kill(worker.pid, signal.SIGKILL)
                    killed_at.append(time.monotonic())
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "rank 1" in error["message"], error
    assert len(events) < 200
    while httpx.get(f"{tp_server.base_url}/health").status_code != 503:
        assert time.monotonic() - killed_at[0] < 10, "health still ok 10 s after the kill"
        time.sleep(0.05)
    assert not worker.is_alive()
    thread = tp_server.app.state.async_engine._thread
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert not dist.is_initialized()  # rank 0 left the group


def test_two_nodes_on_localhost_serve_the_same_tokens(tiny_gpt2_dir, tmp_path):
    """Node 0 serves HTTP and holds rank 0 (in its --engine-process); node 1 is a
    separate --headless command holding rank 1; they meet over TCP. When node 0
    stops, node 1 leaves too, and no process of either is left."""
    port = free_port()
    common = [
        "--model", tiny_gpt2_dir, "--device", "cpu", "-tp", "2", "--nnodes", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-model-len", "256",
        "--num-kv-blocks", "128", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
    ]  # fmt: skip
    log1 = (tmp_path / "node1.log").open("w")
    node1 = subprocess.Popen(
        [sys.executable, "-m", "server", *common, "--node-rank", "1", "--headless"],
        cwd=ROOT,
        stdout=log1,
        stderr=log1,
    )
    node0 = ServerProcess([*common, "--node-rank", "0", "--engine-process"], tmp_path / "node0.log")
    try:
        node0.wait_ready(timeout=180)
        prompts = PROMPTS[:3]
        assert completions(node0.base_url, prompts) == expected_texts(tiny_gpt2_dir, prompts)
        spawned = descendants(node0.proc.pid) + descendants(node1.pid)
        assert len(spawned) >= 2  # node 0's engine process, node 1's rank
        assert node0.stop(signal.SIGTERM, timeout=60) == 0
        assert node1.wait(timeout=30) == 0, (tmp_path / "node1.log").read_text()
        # Each node's processes, multiprocessing's resource tracker included, go.
        deadline = time.monotonic() + 10
        while left := [pid for pid in spawned if Path(f"/proc/{pid}").exists()]:
            assert time.monotonic() < deadline, f"processes left: {left}"
            time.sleep(0.1)
    finally:
        node0.close()
        if node1.poll() is None:
            node1.kill()
            node1.wait()
        log1.close()
