"""The SSE wire format, read raw with httpx."""

from __future__ import annotations

import json

import pytest


def read_events(response) -> list[str]:
    """The `data:` payloads, checking the framing on the way."""
    body = response.read().decode()
    assert body.endswith("\n\n")
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e[len("data: ") :] for e in events]


@pytest.mark.parametrize(
    "path, body, obj",
    [
        ("/v1/completions", {"prompt": "Hello"}, "text_completion"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hello"}]},
            "chat.completion.chunk",
        ),
    ],
)
def test_sse_framing_done_and_usage_chunk(client, path, body, obj):
    request = body | {
        "max_tokens": 5,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", path, json=request) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = read_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {obj}
    assert len({c["id"] for c in chunks}) == 1
    assert all(isinstance(c["created"], int) and c["model"] for c in chunks)
    *content, usage = chunks
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 5
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 5
    # finish_reason only on each choice's last chunk.
    reasons = [c["choices"][0]["finish_reason"] for c in content]
    assert reasons[-1] == "length" and not any(reasons[:-1])


def test_chat_stream_opens_with_role(client):
    request = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=request) as response:
        chunks = [json.loads(e) for e in read_events(response)[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert all(c.get("usage") is None for c in chunks)


def test_streamed_logprobs_offsets_continue(client):
    request = {"prompt": "Hello", "max_tokens": 6, "logprobs": 1, "stream": True}
    with client.stream("POST", "/v1/completions", json=request) as response:
        chunks = [json.loads(e) for e in read_events(response)[:-1]]
    text, offsets = "", []
    for c in chunks:
        lp = c["choices"][0]["logprobs"]
        offsets += lp["text_offset"]
        text += "".join(lp["tokens"])
    assert len(offsets) == 6 and offsets == sorted(offsets) and offsets[0] == 0


def test_echo_streams_the_prompt_first(client):
    request = {"prompt": "Hello", "max_tokens": 2, "echo": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=request) as response:
        chunks = [json.loads(e) for e in read_events(response)[:-1]]
    assert chunks[0]["choices"][0]["text"] == "Hello"


@pytest.mark.parametrize(
    "text", ["hi", 'q"uote\\back', "nl\n\t\r", "\x00\x1f\x7f", "é中😀\ufffd", "\u2028</s>", ""]
)
@pytest.mark.parametrize(
    ("finish_reason", "stop_reason"), [(None, None), ("stop", "é\n"), ("stop", 50256)]
)
def test_text_chunk_template_writes_what_pydantic_writes(text, finish_reason, stop_reason):
    from server.replies import CompletionChoice, CompletionResponse
    from server.serving_completions import TextChunks

    choice = CompletionChoice(
        index=3, text=text, finish_reason=finish_reason, stop_reason=stop_reason
    )
    want = CompletionResponse(id="cmpl-1", created=5, model='m"x', choices=[choice])
    got = TextChunks("cmpl-1", 5, 'm"x')(3, text, finish_reason, stop_reason)
    assert got == want.model_dump_json()
