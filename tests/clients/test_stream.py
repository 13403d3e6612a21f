"""The client reads SSE from raw reads: events cut anywhere between reads must come
out whole, one timestamp per read that completed them."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from clients import stream
from clients.metrics import RequestRecord
from clients.stream import stream_request


def event(text: str, usage: dict | None = None) -> bytes:
    body: dict = {"object": "text_completion", "choices": [{"index": 0, "text": text}]}
    if usage:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\r\n\r\n".encode()


class Reads(httpx.AsyncByteStream):
    """A body delivered in the given pieces, one network read each."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def __aiter__(self):
        for piece in self.pieces:
            await asyncio.sleep(0.002)  # each read at its own time
            yield piece


def run(pieces: list[bytes] | Reads) -> RequestRecord:
    """One request whose body is `pieces` (or that stream of them)."""
    body = pieces if isinstance(pieces, Reads) else Reads(pieces)

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=body)

    async def go() -> RequestRecord:
        record = RequestRecord(index=0)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await stream_request(client, "http://x/v1/completions", {}, record, chat=False)
        return record

    return asyncio.run(go())


def test_events_split_across_reads_come_out_whole():
    body = (
        event(" a")
        + b": ping\r\n\r\n"
        + event(" b")
        + event(" c")
        + event("", {"prompt_tokens": 3, "completion_tokens": 3})
        + b"data: [DONE]\r\n\r\n"
    )
    first = len(event(" a")) // 2  # mid-JSON
    second = body.index(b" c") + 1  # inside the third event, after " b" is whole
    record = run([body[:first], body[first:second], body[second:]])
    assert record.ok, record.error
    assert record.text == " a b c"
    assert (record.prompt_tokens, record.completion_tokens) == (3, 3)
    # " a" and " b" were completed by the second read, " c" by the third.
    t = record.chunk_times
    assert len(t) == 3 and t[0] == t[1] < t[2] and record.end_time == t[2]


@pytest.mark.parametrize(
    "tail, kind",
    [(b"", "protocol"), (b"data: {not json\n\n", "protocol"), (b"data: [1, 2]\n\n", "protocol")],
)
def test_a_broken_stream_fails_the_request(tail, kind):
    record = run([event(" a"), tail] if tail else [event(" a")])
    assert record.error_kind == kind and record.text == " a"


class Tracked(Reads):
    """Reads that note whether the client read them to the end, and can linger."""

    def __init__(self, pieces: list[bytes], linger_s: float = 0.0) -> None:
        super().__init__(pieces)
        self.linger_s = linger_s
        self.finished = False

    async def __aiter__(self):
        async for piece in super().__aiter__():
            yield piece
        await asyncio.sleep(self.linger_s)
        self.finished = True


def test_the_body_is_read_to_its_end_after_done():
    """As the OpenAI SDK does: a response left unread closes its connection, and a
    closed loop would then set up a new one for every request."""
    body = Tracked([event(" a"), b"data: [DONE]\r\n\r\n", b": after\r\n\r\n"])
    record = run(body)
    assert record.ok and record.text == " a"
    assert body.finished


def test_a_stream_left_open_after_done_still_counts(monkeypatch):
    monkeypatch.setattr(stream, "DRAIN_TIMEOUT_S", 0.05)
    body = Tracked([event(" a"), b"data: [DONE]\r\n\r\n"], linger_s=30.0)
    start = time.perf_counter()
    record = run(body)
    assert record.ok, record.error
    assert record.end_time - record.send_time < 1.0  # timed at [DONE]
    assert time.perf_counter() - start < 5.0 and not body.finished
