"""Faults a reliability probe found, one test each: huge prompts, floods, lone
surrogates, slow or idle clients, auth headers, and clients that leave early."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest

from server.prompts import ClientDisconnected, Prompts

HUGE = "hello " * (10 * 2**20 // 6)  # 10 MB of text


def test_a_prompt_too_long_for_any_tokenization_is_rejected_before_tokenizing(client):
    start = time.monotonic()
    r = client.post("/v1/completions", json={"prompt": HUGE, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "characters" in r.json()["error"]["message"]
    # Tokenizing it would take many seconds on this CPU; the bound, a length check.
    assert time.monotonic() - start < 3
    r = client.post("/tokenize", json={"prompt": HUGE})
    assert r.status_code == 400


async def test_a_big_prompt_does_not_hold_up_a_small_one(live):
    """A big text prompt (kept in bounds by truncate_prompt_tokens) takes its tokenizer
    lane for a while; a small request meanwhile has a lane of its own."""
    big = {"prompt": "hello " * 600_000, "max_tokens": 1, "truncate_prompt_tokens": 8}
    small = {"prompt": "Hi there", "max_tokens": 1}
    async with httpx.AsyncClient(base_url=live.base_url, timeout=120) as client:
        big_task = asyncio.ensure_future(client.post("/v1/completions", json=big))
        r = await client.post("/tokenize", json={"prompt": "warm"})  # the big one is sent
        assert r.status_code == 200
        start = time.monotonic()
        r = await client.post("/v1/completions", json=small)
        small_s = time.monotonic() - start
        big_done = big_task.done()
        assert (await big_task).status_code == 200
    assert r.status_code == 200
    assert not big_done and small_s < 1.5


@pytest.fixture(scope="module")
def full(start_server):
    """No room to wait: every generation request is turned away."""
    return start_server(server={"max_waiting_requests": 0})


def test_queue_full_is_decided_before_tokenizing_and_says_when_to_retry(full):
    start = time.monotonic()
    with httpx.Client(base_url=full.base_url, timeout=60) as client:
        for path, body in (
            ("/v1/completions", {"prompt": HUGE}),  # too long, too: the 503 comes first
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": HUGE}]}),
        ):
            r = client.post(path, json=body)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "server_overloaded"
            assert r.headers["retry-after"] == "1"
    assert time.monotonic() - start < 3


S = '"a\\ud800b"'  # JSON for a string holding a lone surrogate
SURROGATE_BODIES = [
    ("/v1/completions", f'{{"prompt": {S}}}', "prompt"),
    ("/v1/completions", f'{{"prompt": ["ok", {S}]}}', "prompt"),
    ("/v1/completions", f'{{"prompt": "x", "stop": [{S}]}}', "stop"),
    ("/v1/completions", f'{{"prompt": "x", "model": {S}}}', "model"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": {S}}}]}}', "messages"),
    ("/tokenize", f'{{"prompt": {S}}}', "prompt"),
]


@pytest.mark.parametrize("path, body, param", SURROGATE_BODIES)
def test_lone_surrogates_are_a_400(client, path, body, param):
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.fixture(scope="module")
def strict_http(start_server):
    return start_server(server={"header_timeout": 0.5, "body_timeout": 0.5, "max_connections": 8})


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """The server closed the connection (EOF or reset) within `seconds`."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass  # a response (a 408 or the like) before the close is fine
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


@pytest.mark.parametrize(
    "sent",
    [
        b"",  # connects and says nothing
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",  # headers a little at a time
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{",  # body cut
    ],
    ids=["idle", "slow headers", "unfinished body"],
)
def test_slow_and_idle_clients_are_closed(strict_http, sent):
    with socket.create_connection(("127.0.0.1", strict_http.port)) as sock:
        sock.sendall(sent)
        assert closed_within(sock, 5)


def test_a_kept_alive_connection_left_idle_is_closed_at_the_header_timeout(strict_http):
    # After a response the header timeout (0.5 s) runs again: the connection goes well
    # before uvicorn's keep-alive timeout (5 s) would close it.
    with socket.create_connection(("127.0.0.1", strict_http.port)) as sock:
        sock.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(5)
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(4096)
        assert head.startswith(b"HTTP/1.1 200")
        assert closed_within(sock, 3)


def test_a_prompt_client_keeps_its_connection(strict_http):
    with httpx.Client(base_url=strict_http.base_url) as client:
        for _ in range(2):  # the same kept-alive connection
            assert client.post("/tokenize", json={"prompt": "Hi"}).status_code == 200


def test_connections_past_the_cap_get_503(strict_http):
    socks = [socket.create_connection(("127.0.0.1", strict_http.port)) for _ in range(8)]
    try:
        r = httpx.get(f"{strict_http.base_url}/v1/models")
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    finally:
        for sock in socks:
            sock.close()


@pytest.fixture(scope="module")
def keyed(start_server):
    return start_server(server={"api_key": "sekret"})


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_bearer_scheme_is_case_insensitive(keyed, scheme):
    r = httpx.get(f"{keyed.base_url}/v1/models", headers={"Authorization": f"{scheme} sekret"})
    assert r.status_code == 200


def test_401_says_how_to_authenticate(keyed):
    r = httpx.get(f"{keyed.base_url}/v1/models", headers={"Authorization": "Basic sekret"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"


class GoneClient:
    """A request whose client has already disconnected."""

    async def receive(self) -> dict:
        return {"type": "http.disconnect"}


async def test_tokenizer_work_of_a_client_that_left_is_dropped(tokenizer):
    prompts = Prompts(tokenizer, 256)
    busy, started, ran = threading.Event(), threading.Event(), []

    def block() -> None:
        started.set()
        busy.wait()

    try:
        blocker = asyncio.ensure_future(prompts.run(None, 0, block))
        await asyncio.to_thread(started.wait)  # the small lane is taken
        with pytest.raises(ClientDisconnected):
            await prompts.run(GoneClient(), 0, ran.append, "work")
        busy.set()
        await blocker
        await prompts.run(None, 0, ran.append, "after")  # the lane goes on
        assert ran == ["after"]  # the dropped work never ran
    finally:
        busy.set()
        prompts.close()
