"""GPT-OSS's harmony answers: `--reasoning-parser openai_gptoss` and `--tool-call-parser
openai` on whole texts, streamed in every split (the deltas concatenate to what the whole
text gives), and through a live server whose answer a one-string choice forces; the
parser a GPT-OSS directory gets by default; `reasoning_effort`."""

from __future__ import annotations

import json

import httpx
import pytest

from engine.engine import Engine
from server.parser_names import PARSERS
from server.reasoning import default_parser, split
from server.tool_parsers import DraftCall
from server.tools import ToolStream
from tests.server.test_reasoning import streamed

CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)
THINK = "<|channel|>analysis<|message|>the user wants weather<|end|>"
CASES = [  # (answer, reasoning, content, calls)
    (
        "<|channel|>analysis<|message|>two and two<|end|>"
        "<|start|>assistant<|channel|>final<|message|>four<|return|>",
        "two and two",
        "four",
        [],
    ),
    ("<|channel|>final<|message|>four", None, "four", []),  # no reasoning at all
    ('{"a": 1}', None, '{"a": 1}', []),  # no harmony (a grammar forced it): content
    (THINK + CALL, "the user wants weather", "", [DraftCall("get_weather", '{"city": "Paris"}')]),
    (  # the recipient before the channel; a preamble to the user first
        THINK
        + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
        + '<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"x": [1]}<|call|>',
        "the user wants weather",
        "Checking.",
        [DraftCall("f", '{"x": [1]}')],
    ),
    (THINK + "<|start|>assistant<|chan", "the user wants weather", "", []),  # cut in a header
]


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), CASES)
def test_whole_answers(text, reasoning, content, calls):
    found = split("openai_gptoss", text)
    assert found.reasoning == reasoning
    extracted = PARSERS["openai"]().extract(found.content, final=True)
    assert (extracted.content, extracted.calls) == (content, calls)
    if not calls:
        assert found.content == content  # without calls the split is clean already


def streamed_calls(text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    """The content and calls a ToolStream's deltas add up to, text fed in pieces."""
    stream, bounds = ToolStream(PARSERS["openai"]()), [0, *cuts, len(text)]
    content, calls = "", []
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        delta = stream.feed(text[a:b], final=k == len(bounds) - 2)
        content += delta.get("content", "")
        for piece in delta.get("tool_calls", []):
            if piece["index"] == len(calls):
                calls.append((piece["function"]["name"], ""))
            name, arguments = calls[piece["index"]]
            calls[piece["index"]] = (name, arguments + piece["function"]["arguments"])
    return content, calls


def every_split(text: str) -> list[list[int]]:
    return [[i] for i in range(1, len(text))] + [list(range(1, len(text)))]


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), CASES)
def test_streamed_in_every_two_way_and_char_split(text, reasoning, content, calls):
    whole = split("openai_gptoss", text)
    for cuts in every_split(text):
        got_reasoning, got_content, kinds = streamed("openai_gptoss", text, cuts)
        assert (got_reasoning or "", got_content) == (whole.reasoning or "", whole.content)
        assert kinds == sorted(kinds, key=lambda kind: kind == "content"), cuts
    want_calls = [(c.name, c.arguments) for c in calls]
    for cuts in every_split(whole.content):
        assert streamed_calls(whole.content, cuts) == (content, want_calls), cuts


def test_gpt_oss_directories_default_to_the_harmony_parser(tiny_family_dir, tiny_llama_dir):
    assert default_parser(tiny_family_dir("gpt_oss")) == "openai_gptoss"
    assert default_parser(tiny_llama_dir) is None


class RecordingEngine(Engine):
    """Notes each request's skip_special_tokens."""

    skips: list[bool] = []

    def add_request(self, request_id, prompt_token_ids, params, *args):
        self.skips.append(params.skip_special_tokens)
        super().add_request(request_id, prompt_token_ids, params, *args)


@pytest.fixture(scope="module")
def harmony_server(start_server):
    parsers = {
        "reasoning_parser": "openai_gptoss",
        "enable_auto_tool_choice": True,
        "tool_call_parser": "openai",
    }
    return start_server(server=parsers, engine_factory=RecordingEngine)


def chat(server, body: dict, model_name: str) -> tuple[dict, tuple[str, str, list]]:
    """The whole answer's choice, and (reasoning, content, calls) of the same streamed."""
    body = {"model": model_name, "messages": [{"role": "user", "content": "Hi"}]} | body
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        whole = r.json()["choices"][0]
        reasoning, content, calls = "", "", []
        with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:])["choices"]:
                    reasoning += choice["delta"].get("reasoning_content") or ""
                    content += choice["delta"].get("content") or ""
                    for piece in choice["delta"].get("tool_calls") or []:
                        if piece["index"] == len(calls):
                            calls.append(piece["function"]["name"])
                        calls.append(piece["function"]["arguments"])
    return whole, (reasoning, content, calls)


def test_live_reasoning_and_answer(harmony_server, model_name):
    forced = CASES[0][0]
    body = {"structured_outputs": {"choice": [forced]}, "max_tokens": 220}
    whole, streamed_parts = chat(harmony_server, body, model_name)
    assert whole["message"]["reasoning_content"] == "two and two"
    assert whole["message"]["content"] == "four"
    assert streamed_parts == ("two and two", "four", [])
    assert RecordingEngine.skips and not any(RecordingEngine.skips)  # markers decoded


def test_live_tool_call(harmony_server, model_name):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    body = {"structured_outputs": {"choice": [THINK + CALL]}, "max_tokens": 220, "tools": tools}
    whole, (reasoning, content, calls) = chat(harmony_server, body, model_name)
    assert whole["finish_reason"] == "tool_calls"
    call = whole["message"]["tool_calls"][0]["function"]
    assert (call["name"], call["arguments"]) == ("get_weather", '{"city": "Paris"}')
    assert whole["message"]["reasoning_content"] == "the user wants weather"
    assert (reasoning, content) == ("the user wants weather", "")
    assert calls[0] == "get_weather" and "".join(calls[1:]) == '{"city": "Paris"}'


def test_reasoning_effort_is_taken_and_checked(live, model_name):
    body = {"model": model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    with httpx.Client(base_url=live.base_url, timeout=60) as client:
        ok = client.post("/v1/chat/completions", json=body | {"reasoning_effort": "low"})
        assert ok.status_code == 200
        bad = client.post("/v1/chat/completions", json=body | {"reasoning_effort": "extreme"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"
