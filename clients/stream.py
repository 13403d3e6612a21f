"""One streaming request against an OpenAI-compatible server, timed chunk by chunk."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx

from clients.metrics import RequestRecord
from clients.workload import RequestSpec

DRAIN_TIMEOUT_S = 1.0  # for the rest of a body after its [DONE]


def request_body(spec: RequestSpec, model: str, chat: bool) -> dict:
    body: dict = {
        "model": model,
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "stream": True,
        # Ask for the usage chunk so output tokens are the server's count, not ours.
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    if spec.ignore_eos:
        # vLLM extension; sent only when wanted, since strict servers reject unknown fields.
        body["ignore_eos"] = True
    return body


def error_message(payload: object) -> str:
    """The message of an OpenAI error body ({"error": {"message"}}) or vLLM's flat form."""
    if isinstance(payload, dict):
        err = payload.get("error", payload)
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    return str(payload)


def chunk_text(event: dict, chat: bool) -> str:
    parts = []
    for choice in event.get("choices") or []:
        if chat:
            parts.append((choice.get("delta") or {}).get("content") or "")
        else:
            parts.append(choice.get("text") or "")
    return "".join(parts)


def _body(response: httpx.Response):
    """The response body as it arrives. Raw reads skip httpx's text and line decoders
    (three async generators per read): at 100k+ tokens/s those were most of the
    client's time. Compressed bodies still go through the decoder."""
    if response.headers.get("content-encoding", "identity") == "identity":
        return response.aiter_raw()
    return response.aiter_bytes()


async def _drain(body) -> None:
    async for _ in body:
        pass


def _take_event(
    record: RequestRecord, event: object, payload: bytes, chat: bool, now: float
) -> bool:
    """Fold one stream event into record; False when it ends the request (an error)."""
    if not isinstance(event, dict):
        text = payload[:200].decode("utf-8", "replace")
        record.fail("protocol", f"stream event is not a JSON object: {text}")
        return False
    if "error" in event or event.get("object") == "error":
        record.fail("stream", error_message(event))
        return False
    text = chunk_text(event, chat)
    if text:
        record.chunk_times.append(now)
        record.text += text
    if usage := event.get("usage"):
        record.prompt_tokens = usage.get("prompt_tokens")
        record.completion_tokens = usage.get("completion_tokens")
    return True


async def stream_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict,
    record: RequestRecord,
    chat: bool,
) -> None:
    """Send one request and fill `record` in place.

    Filling in place keeps the timestamps already seen when the caller cancels
    us on timeout. Every failure ends up in `record.error`; nothing is raised.
    """
    record.send_time = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                raw = await response.aread()
                try:
                    message = error_message(json.loads(raw))
                except ValueError:
                    message = raw.decode("utf-8", "replace")[:500]
                record.fail("http", f"HTTP {response.status_code}: {message}")
                return
            got_done = False
            pending = b""  # a line cut off at the end of the last read
            body = _body(response)
            async for data in body:
                now = time.perf_counter()
                lines = (pending + data).split(b"\n")
                pending = lines.pop()
                for line in lines:
                    # SSE: skip blank separators, comments (": ping") and other fields.
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        got_done = True
                        record.end_time = now
                        break
                    if not _take_event(record, json.loads(payload), payload, chat, now):
                        return
                if got_done:
                    break
            if not got_done:
                record.fail("protocol", "stream ended without 'data: [DONE]'")
                return
            # Read the body to its end, as the OpenAI SDK does: httpx closes a connection
            # whose response was left unread, so every request of a closed loop would
            # set one up anew (server and client both). A server that keeps the stream
            # open after [DONE] costs a second, and its connection.
            with contextlib.suppress(asyncio.TimeoutError, httpx.HTTPError):
                await asyncio.wait_for(_drain(body), DRAIN_TIMEOUT_S)
    except json.JSONDecodeError as e:
        record.fail("protocol", f"bad JSON in stream: {e}")
    except httpx.TimeoutException as e:
        record.fail("timeout", f"{type(e).__name__}: {e}")
    except httpx.HTTPError as e:
        record.fail("connection", f"{type(e).__name__}: {e}")
    except Exception as e:
        # A malformed event (odd field types) fails this request, never the whole run.
        record.fail("protocol", f"{type(e).__name__}: {e}")
    finally:
        # Also runs on cancellation (timeout), so a cut-off request has an end too.
        if record.end_time is None:
            record.end_time = time.perf_counter()
