"""--reasoning-parser: <think> ... </think> split into reasoning_content, on whole texts,
streamed in every split (the deltas concatenate to what the whole text gives), and
through a live server whose answer a one-string choice forces."""

from __future__ import annotations

import json

import httpx
import pytest

from server import reasoning
from server.reasoning import ReasoningStream, Split, split

R1_CASES = [
    ("<think>\nadd them</think>\n\nFour.", Split("\nadd them", "\n\nFour.")),
    ("add them</think>Four.", Split("add them", "Four.")),  # the template opened <think>
    ("still thinking <", Split("still thinking <", "")),  # never closed: all reasoning
    ("</think>", Split("", "")),
]
QWEN3_CASES = [
    ("<think>\nadd them\n</think>\n\nFour.", Split("\nadd them\n", "\n\nFour.")),
    ("Four.", Split(None, "Four.")),  # not thinking (enable_thinking false): all content
    ("<thin air", Split(None, "<thin air")),
    ("<think>cut short", Split("cut short", "")),
]


@pytest.mark.parametrize("parser", ["deepseek_r1", "minimax_m2"])
@pytest.mark.parametrize(("text", "want"), R1_CASES)
def test_deepseek_r1_whole_text(parser, text, want):
    assert split(parser, text) == want  # MiniMax-M2's template opens <think> too


@pytest.mark.parametrize(("text", "want"), QWEN3_CASES)
def test_qwen3_whole_text(text, want):
    assert split("qwen3", text) == want


def streamed(parser: str, text: str, cuts: list[int]) -> tuple[str | None, str, list[str]]:
    """Feed text in pieces cut at `cuts`: (reasoning, content, the deltas' kinds in order)."""
    stream, bounds = ReasoningStream(parser), [0, *cuts, len(text)]
    reasoning, content, kinds = None, "", []
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        delta, news = stream.feed(text[a:b], final=k == len(bounds) - 2)
        if "reasoning_content" in delta:
            reasoning = (reasoning or "") + delta["reasoning_content"]
            kinds.append("reasoning")
        if news:
            content += news
            kinds.append("content")
    return reasoning, content, kinds


@pytest.mark.parametrize(
    ("parser", "text", "want"),
    [("deepseek_r1", t, w) for t, w in R1_CASES]
    + [(parser, t, w) for t, w in QWEN3_CASES for parser in ("qwen3", "glm45")],
)
def test_streamed_in_every_two_way_and_char_split(parser, text, want):
    splits = [[i] for i in range(1, len(text))] + [list(range(1, len(text)))]
    for cuts in splits:
        reasoning, content, kinds = streamed(parser, text, cuts)
        # Reasoning that ends empty may send no delta at all.
        assert (reasoning or "", content) == (want.reasoning or "", want.content), cuts
        assert kinds == sorted(kinds, key=lambda kind: kind == "content"), cuts  # never back


@pytest.mark.parametrize(
    ("parser", "opening", "closing"),
    [
        ("deepseek_r1", "<think>", "</think>"),
        ("qwen3", "<think>", "</think>"),
        (
            "openai_gptoss",
            "<|channel|>analysis<|message|>",
            "<|end|><|start|>assistant<|channel|>final<|message|>",
        ),
    ],
)
def test_pieces_without_a_tag_are_not_parsed_again(parser, opening, closing, monkeypatch):
    """A long answer streams in linear time: after a parse, pieces that start no tag
    extend the part the text ended in without the answer being parsed again."""
    parses = []
    real = reasoning.split
    monkeypatch.setattr(reasoning, "split", lambda *args: parses.append(1) or real(*args))
    stream = ReasoningStream(parser)
    pieces = [f" word{i}" for i in range(100)]
    news = [stream.feed(opening, False), *(stream.feed(p, False) for p in pieces)]
    assert "".join(delta.get("reasoning_content", "") for delta, _ in news) == "".join(pieces)
    news = [stream.feed(closing, False), *(stream.feed(p, False) for p in pieces)]
    news.append(stream.feed(" end", True))
    assert "".join(content for _, content in news) == "".join(pieces) + " end"
    assert len(parses) <= 5


THOUGHT, ANSWER = "two and two", "four"
FORCED = f"<think>{THOUGHT}</think>{ANSWER}"


@pytest.fixture(scope="module")
def r1_server(start_server):
    return start_server(server={"reasoning_parser": "deepseek_r1"})


@pytest.fixture(scope="module")
def forced(r1_server, model_name) -> tuple[dict, dict]:
    """The request whose one-string choice forces FORCED, and its (whole) answer."""
    body = {
        "model": model_name,
        "messages": [{"role": "user", "content": "What is two and two?"}],
        "structured_outputs": {"choice": [FORCED]},
        "max_tokens": 40,
    }
    r = httpx.post(f"{r1_server.base_url}/v1/chat/completions", json=body, timeout=60)
    return body, r.json()["choices"][0]["message"]


def test_live_answer_split_whole_and_streamed(r1_server, forced):
    body, message = forced
    assert (message["reasoning_content"], message["content"]) == (THOUGHT, ANSWER)
    with httpx.Client(base_url=r1_server.base_url, timeout=60) as client:
        reasoning, content = "", ""
        with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:])["choices"]:
                    assert not (content and choice["delta"].get("reasoning_content"))
                    reasoning += choice["delta"].get("reasoning_content") or ""
                    content += choice["delta"].get("content") or ""
        assert (reasoning, content) == (THOUGHT, ANSWER)


def test_an_answer_with_its_reasoning_goes_back_into_the_history(r1_server, forced, model_name):
    body, message = forced
    assert message["reasoning_content"] == THOUGHT
    with httpx.Client(base_url=r1_server.base_url, timeout=60) as client:
        follow_up = [*body["messages"], message, {"role": "user", "content": "And three?"}]
        again = {"model": model_name, "messages": follow_up, "max_tokens": 2}
        assert client.post("/v1/chat/completions", json=again).status_code == 200
        misplaced = [{"role": "user", "content": "Hi", "reasoning_content": "no"}]
        r = client.post("/v1/chat/completions", json=again | {"messages": misplaced})
        assert r.status_code == 400 and "reasoning_content" in r.json()["error"]["message"]


def test_templates_get_the_reasoning_under_both_names():
    from server.prompts import template_message
    from server.protocol import ChatMessage

    message = ChatMessage(role="assistant", content="four", reasoning_content="two and two")
    out = template_message(message)
    assert (out["reasoning_content"], out["thinking"]) == ("two and two", "two and two")
