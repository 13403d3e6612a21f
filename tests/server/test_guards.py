"""--api-key, the waiting-queue bound, the body-size cap and CORS."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_CAP = 4096


@pytest.fixture(scope="module")
def guarded(start_server):
    """One request at a time, one more may wait; a key; a small body cap; CORS for one origin."""
    return start_server(
        engine={"max_num_seqs": 1},
        server={
            "api_key": KEY,
            "max_waiting_requests": 1,
            "max_request_body_bytes": BODY_CAP,
            "allowed_origins": ["http://ui.example"],
        },
    )


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/tokenize"),
        ("POST", "/rerank"),
        ("POST", "/v2/rerank"),
        ("POST", "/score"),
    ],
)
def test_api_key_required(guarded, headers, method, path):
    r = httpx.request(method, guarded.base_url + path, headers=headers, json={"prompt": "x"})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert r.json()["error"]["type"] == "authentication_error"


def test_api_key_accepted_and_probes_open(guarded, model_name):
    assert httpx.get(guarded.base_url + "/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(guarded.base_url + "/health").status_code == 200
    assert httpx.get(guarded.base_url + "/metrics").status_code == 200
    sdk = openai.OpenAI(base_url=guarded.base_url + "/v1", api_key=KEY, max_retries=0)
    assert sdk.completions.create(model=model_name, prompt="Hi", max_tokens=2).choices
    bad = openai.OpenAI(base_url=guarded.base_url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_huge_body_gets_413(guarded):
    body = {"prompt": "x" * (2 * BODY_CAP)}
    r = httpx.post(guarded.base_url + "/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 413 and r.json()["error"]["message"]

    def chunked():  # no Content-Length: the cap is enforced while reading
        yield b'{"prompt": "'
        for _ in range(8):
            yield b"x" * 1024
        yield b'"}'

    headers = AUTH | {"content-type": "application/json"}
    r = httpx.post(guarded.base_url + "/v1/completions", content=chunked(), headers=headers)
    assert r.status_code == 413 and r.json()["error"]["message"]
    ok = {"prompt": "Hi", "max_tokens": 1}
    assert (
        httpx.post(guarded.base_url + "/v1/completions", json=ok, headers=AUTH).status_code == 200
    )


def test_cors_only_for_allowed_origins(guarded, live):
    preflight = {
        "Origin": "http://ui.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    r = httpx.options(guarded.base_url + "/v1/completions", headers=preflight)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://ui.example"
    r = httpx.options(
        guarded.base_url + "/v1/completions", headers=preflight | {"Origin": "http://evil"}
    )
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(live.base_url + "/v1/models", headers={"Origin": "http://ui.example"})
    assert "access-control-allow-origin" not in r.headers  # CORS off by default


async def wait_for(guarded, sample: str, value: float) -> None:
    for _ in range(100):
        if await asyncio.to_thread(guarded.metric, sample) == value:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{sample} never reached {value}")


async def test_full_waiting_queue_gets_503(guarded):
    long = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=guarded.base_url, headers=AUTH, timeout=60) as client:
        async with client.stream("POST", "/v1/completions", json=long) as running:
            assert running.status_code == 200
            await wait_for(guarded, "pagoda:num_requests_running", 1)
            async with client.stream("POST", "/v1/completions", json=long) as waiting:
                assert waiting.status_code == 200
                await wait_for(guarded, "pagoda:num_requests_waiting", 1)
                r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
                assert r.status_code == 503
                assert r.json()["error"]["type"] == "server_error"
                assert r.json()["error"]["code"] == "server_overloaded"
        await wait_for(guarded, "pagoda:num_requests_running", 0)
        await wait_for(guarded, "pagoda:num_requests_waiting", 0)
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 200
