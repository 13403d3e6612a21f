"""Reasoning models' thinking, split from their answers: `--reasoning-parser`, as vLLM's.

DeepSeek-R1 and its distills, and Qwen3 in thinking mode, write their reasoning between
<think> and </think> before the answer. A chat answer then carries the reasoning as
`reasoning_content` and the rest as `content` (streamed: `reasoning_content` deltas
until </think>, then `content` ones). The two parsers differ on an answer with no
</think>: R1's templates open <think> in the prompt, so everything before </think> is
reasoning, and an answer that never closes it is all reasoning; Qwen3 reasons only when
the answer opens <think> itself (no thinking, `enable_thinking: false`, is plain content);
`glm45` (GLM-4.5/4.6) is Qwen3's; `minimax_m2` (MiniMax-M2, whose template opens <think>
in the prompt too) is R1's.
GPT-OSS writes OpenAI's harmony messages instead: `openai_gptoss` (server/harmony.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server import harmony
from server.tool_parsers import partial_suffix

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3", "glm45", "minimax_m2", "openai_gptoss")
# Reasoning only where the answer opens <think> itself (GLM-4.5 writes as Qwen3 does).
OPENS_ITS_OWN = ("qwen3", "glm45")
# The parsers whose markers are special tokens: their answers are decoded with them.
KEEPS_SPECIAL_TOKENS = ("openai_gptoss",)


def default_parser(model_dir: str) -> str | None:
    """The parser a model's chat answers need whatever the flags say: GPT-OSS always
    writes harmony messages (vLLM parses them for it too)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return "openai_gptoss" if config.get("model_type") == "gpt_oss" else None


@dataclass(frozen=True)
class Split:
    reasoning: str | None  # None: the answer had no reasoning
    content: str
    # The part text appended to this one extends when it starts no tag ("reasoning" or
    # "content"); None when a tag may be under way at the end (held back) or none is known.
    tail: str | None = field(default=None, compare=False)


def split(parser: str, text: str, final: bool = True) -> Split:
    """An answer's reasoning and content. Not final: a tag the text may still be
    completing is held back from both."""
    if parser == "openai_gptoss":
        return Split(*harmony.split(text, final))
    opened = text.startswith(START)
    body = text[len(START) :] if opened else text
    if not opened and not final and START.startswith(text):
        return Split(None, "")  # perhaps "<think>" still arriving
    if END in body:
        reasoning, _, content = body.partition(END)
        return Split(reasoning, content, "content")
    if parser in OPENS_ITS_OWN and not opened:
        return Split(None, text, "content")
    held = 0 if final else partial_suffix(body, END)
    return Split(body[: len(body) - held], "", None if held else "reasoning")


@dataclass
class ReasoningStream:
    """One streamed choice: what each new piece of text adds to its reasoning and to
    its content (the content goes on to the tool-call stream when there is one)."""

    parser: str
    text: str = ""
    reasoning_sent: int = 0
    content_sent: int = 0
    tail: str | None = None  # the last parse's Split.tail

    def feed(self, new_text: str, final: bool) -> tuple[dict[str, Any], str]:
        """({"reasoning_content": news} or {}, the content's news)."""
        self.text += new_text
        if self.tail is not None and not final and "<" not in new_text:
            # Every tag and harmony marker starts with "<": text without one extends the
            # part the text ended in, so the answer so far is not parsed again (that would
            # cost the whole answer's length on every token).
            if self.tail == "reasoning":
                self.reasoning_sent += len(new_text)
                return ({"reasoning_content": new_text} if new_text else {}), ""
            self.content_sent += len(new_text)
            return {}, new_text
        found = split(self.parser, self.text, final)
        self.tail = found.tail
        delta: dict[str, Any] = {}
        if found.reasoning is not None and len(found.reasoning) > self.reasoning_sent:
            delta["reasoning_content"] = found.reasoning[self.reasoning_sent :]
            self.reasoning_sent = len(found.reasoning)
        content = found.content[self.content_sent :]
        self.content_sent = len(found.content)
        return delta, content
