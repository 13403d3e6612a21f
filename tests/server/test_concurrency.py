"""Many streams at once, and streams dropped midway: the engine frees what they held."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx


async def stream_text(client: httpx.AsyncClient, body: dict) -> tuple[str, dict]:
    """One streamed completion: its text, and its usage chunk ({} if none came)."""
    text, usage = "", {}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            assert "error" not in chunk, chunk
            if chunk["choices"]:
                text += chunk["choices"][0]["text"]
            else:
                usage = chunk["usage"]
    return text, usage


def greedy_stream_bodies(prompt: str, count: int, first_max_tokens: int) -> list[dict]:
    """`count` greedy streamed completions of growing length, each with a usage chunk."""
    return [
        {
            "prompt": f"{prompt} {i} says",
            "max_tokens": first_max_tokens + i,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for i in range(count)
    ]


def assert_streams_match(base_url: str, bodies: list[dict], streamed: list) -> None:
    """Each stream's text and usage equal the server at base_url's plain answer."""
    for body, (text, usage) in zip(bodies, streamed, strict=True):
        plain = {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}
        expected = httpx.post(f"{base_url}/v1/completions", json=plain, timeout=120).json()
        assert text == expected["choices"][0]["text"]
        assert usage == expected["usage"]


async def stream_completion(client: httpx.AsyncClient, i: int, max_tokens: int) -> tuple[str, int]:
    body = {
        "prompt": f"Request number {i}:",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, usage = await stream_text(client, body)
    return text, usage["completion_tokens"]


async def test_64_concurrent_streams_complete(live):
    limits = httpx.Limits(max_connections=100)
    async with httpx.AsyncClient(base_url=live.base_url, timeout=120, limits=limits) as client:
        results = await asyncio.gather(*(stream_completion(client, i, 8) for i in range(64)))
    assert [tokens for _, tokens in results] == [8] * 64


async def drop_after(client: httpx.AsyncClient, i: int, num_chunks: int) -> None:
    body = {"prompt": f"Dropped {i}", "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        seen = 0
        async for line in response.aiter_lines():
            seen += line.startswith("data: ")
            if seen >= num_chunks:
                break  # leaving the block closes the connection mid-stream


def wait_for_idle(live, timeout: float = 5.0) -> tuple[float, float]:
    deadline = time.monotonic() + timeout
    while True:
        running = live.metric("pagoda:num_requests_running")
        usage = live.metric("pagoda:kv_cache_usage_perc")
        if (running == 0 and usage == 0) or time.monotonic() > deadline:
            return running, usage
        time.sleep(0.1)


ABORTED = 'pagoda:request_success_total{finished_reason="abort"}'


async def test_dropped_streams_are_aborted_and_free_their_blocks(live):
    aborted = live.metric(ABORTED, default=0)
    async with httpx.AsyncClient(base_url=live.base_url, timeout=60) as client:
        await asyncio.gather(*(drop_after(client, i, 3) for i in range(16)))
    assert await asyncio.to_thread(wait_for_idle, live) == (0, 0)
    assert live.metric(ABORTED) == aborted + 16  # aborted, not run to max_tokens


async def test_non_streaming_disconnect_aborts(live):
    aborted = live.metric(ABORTED, default=0)
    body = {"prompt": "Slow one", "max_tokens": 240, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=live.base_url, timeout=60) as client:
        post = asyncio.ensure_future(client.post("/v1/completions", json=body))
        deadline = time.monotonic() + 30
        while await asyncio.to_thread(live.metric, "pagoda:num_requests_running") == 0:
            assert time.monotonic() < deadline and not post.done()
        post.cancel()  # the client gives up and closes the connection
        with contextlib.suppress(asyncio.CancelledError):
            await post
    assert await asyncio.to_thread(wait_for_idle, live) == (0, 0)
    assert live.metric(ABORTED) == aborted + 1
