"""A tiny fake OpenAI-compatible streaming server for the client tests.

It runs uvicorn in a thread on a free 127.0.0.1 port. Each content chunk is one
token " tok", sent `delay_s` apart; markers in the prompt pick failure modes:

    [http-error]    400 with an OpenAI error body
    [stream-error]  two tokens, then an error event in the stream
    [slow]          waits 2 s before the first token (to trip client timeouts)
    [no-usage]      no usage chunk even when asked for one
    [no-done]       the stream ends without `data: [DONE]`
    [bad-json]      a stream line that is not JSON
    [bad-event]     a JSON event that is not an object, or has odd field types
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL = "fake-model"
TOKEN = " tok"


@dataclass
class FakeServer:
    base_url: str
    delay_s: float = 0.005
    bodies: list[dict] = field(default_factory=list)
    # (method, client port) of every request, in arrival order: which connection it came on
    peers: list[tuple[str, int]] = field(default_factory=list)


def _prompt_of(body: dict) -> str:
    if "messages" in body:
        return str(body["messages"][-1]["content"])
    return str(body.get("prompt", ""))


def _chunk(body: dict, chat: bool, text: str | None, finish: str | None = None) -> str:
    if chat:
        delta = {"role": "assistant", "content": ""} if text is None else {"content": text}
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish}
        obj = "text_completion"
    event = {"id": "x", "object": obj, "model": body["model"], "choices": [choice]}
    return f"data: {json.dumps(event)}\n\n"


def make_app(state: FakeServer) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.middleware("http")
    async def log_peer(request: Request, call_next):
        state.peers.append((request.method, request.client.port))
        return await call_next(request)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    async def generate(request: Request, chat: bool):
        body = await request.json()
        state.bodies.append(body)
        prompt = _prompt_of(body)
        n = int(body.get("max_tokens") or 16)
        if "[http-error]" in prompt:
            error = {"message": "prompt rejected", "type": "invalid_request_error"}
            return JSONResponse({"error": error | {"param": None, "code": None}}, 400)
        if not body.get("stream"):
            text = TOKEN * n
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}}
                if chat
                else {"index": 0, "text": text}
            )
            usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
            return {"id": "x", "model": body["model"], "choices": [choice], "usage": usage}

        async def events() -> AsyncIterator[str]:
            if chat:  # role-only first chunk, as OpenAI sends: not content, not TTFT
                yield _chunk(body, chat, None)
            if "[bad-json]" in prompt:
                yield "data: {not json\n\n"
            if "[bad-event]" in prompt:
                yield "data: [1, 2]\n\n" if "list" in prompt else 'data: {"choices": 5}\n\n'
            if "[slow]" in prompt:
                await asyncio.sleep(2.0)
            for i in range(n):
                await asyncio.sleep(state.delay_s)
                if "[stream-error]" in prompt and i == 2:
                    yield f"data: {json.dumps({'error': {'message': 'engine exploded'}})}\n\n"
                    return
                yield _chunk(body, chat, TOKEN)
            yield _chunk(body, chat, "", finish="length")  # empty: not a content chunk
            wants_usage = (body.get("stream_options") or {}).get("include_usage")
            if wants_usage and "[no-usage]" not in prompt:
                usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
                yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n"
            if "[no-done]" not in prompt:
                yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    return app


@pytest.fixture(scope="session")
def fake_server() -> Iterator[FakeServer]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    state = FakeServer(base_url=f"http://127.0.0.1:{port}")
    config = uvicorn.Config(make_app(state), log_level="warning", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    yield state
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


@pytest.fixture
def fake(fake_server: FakeServer) -> FakeServer:
    """The shared fake server, with the request log and delay reset for this test."""
    fake_server.bodies.clear()
    fake_server.peers.clear()
    fake_server.delay_s = 0.005
    return fake_server
