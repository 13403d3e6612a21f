"""OpenAI's harmony format, which GPT-OSS writes its chat answers in: a sequence of
messages, each a header and a body,

    [<|start|>assistant][ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]
    <|message|>BODY<|end|> (or <|return|> at the answer's end, <|call|> after a tool call)

(the first message's <|start|>assistant is the prompt's). The `analysis` channel is the
model's reasoning, `final` its answer, and `commentary` either a preamble to the user
or, with a recipient `functions.NAME`, a call of that tool whose body is its arguments.

`--reasoning-parser openai_gptoss` (vLLM's name) splits an answer into reasoning (the
analysis bodies) and content: the other bodies, and each tool call as the model wrote it,
header included, for `--tool-call-parser openai` to read. Text before any header (an
answer a grammar forced, say) is content. The markers are special tokens, so the server
decodes these answers with them (skip_special_tokens off). On a growing text the parts
only grow: a header counts once its <|message|> has come, and a marker that may be
arriving at the end of a body is held back, as in server/reasoning.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from server.tool_parsers import DraftCall, Extracted, ToolParser, partial_suffix

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
HEADER_MARKERS = (START, CHANNEL)
_HEADER_OPEN = re.compile(r"<\|start\|>|<\|channel\|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass(frozen=True)
class Message:
    channel: str | None  # None: text outside any header
    recipient: str | None  # "functions.NAME" for a tool call
    header: str  # as written, through <|message|> ("" for text outside a header)
    body: str  # as far as it has come
    end: str  # its end marker, "" while it has none


def parse(text: str, final: bool) -> list[Message]:
    """The messages in text, as far as they have come (final: no more text comes, and
    nothing is held back)."""
    return _parse(text, final)[0]


def _parse(text: str, final: bool) -> tuple[list[Message], int]:
    """`parse`'s messages, and how many characters at the end none of them holds (held
    back as a possible marker, or a header whose <|message|> has not come)."""
    messages: list[Message] = []
    pos, n, rest = 0, len(text), 0
    while pos < n:
        opened = _HEADER_OPEN.match(text, pos)
        if opened is None:  # text outside a header: up to the next one
            nxt = _HEADER_OPEN.search(text, pos)
            stop = n if nxt is None else nxt.start()
            held = 0 if final or nxt is not None else _held(text[pos:stop], HEADER_MARKERS)
            if stop - held > pos:
                messages.append(Message(None, None, "", text[pos : stop - held], ""))
            pos, rest = stop, held
            if nxt is None:
                break
            continue
        body_start = text.find(MESSAGE, pos)
        if body_start < 0:
            rest = n - pos
            break  # a header still arriving (or cut off: no message yet)
        body_start += len(MESSAGE)
        header = text[pos:body_start]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        ends = [(i, end) for end in ENDS if (i := text.find(end, body_start)) >= 0]
        if ends:
            stop, end = min(ends)
            body, pos = text[body_start:stop], stop + len(end)
        else:
            body, end, pos = text[body_start:], "", n
            if not final:
                rest = _held(body, ENDS)
                body = body[: len(body) - rest]
        messages.append(
            Message(
                channel[1] if channel else "",
                recipient[1] if recipient else None,
                header,
                body,
                end,
            )
        )
    return messages, rest


def _held(text: str, markers: tuple[str, ...]) -> int:
    return max(partial_suffix(text, marker) for marker in markers)


def is_call(message: Message) -> bool:
    return message.recipient is not None and message.recipient.startswith("functions.")


def split(text: str, final: bool) -> tuple[str | None, str, str | None]:
    """(reasoning, content, tail): reasoning None when the answer has no analysis
    message; tail the part ("reasoning" or "content") that text after this would extend
    if it starts no marker, None when a marker or header may be under way at the end."""
    reasoning: str | None = None
    content = []
    messages, rest = _parse(text, final)
    for message in messages:
        if message.channel == "analysis":
            reasoning = (reasoning or "") + message.body
        elif is_call(message):  # kept whole for the tool parser
            content.append(message.header + message.body + message.end)
        else:
            content.append(message.body)
    tail = None
    if messages and not rest and not messages[-1].end:
        tail = "reasoning" if messages[-1].channel == "analysis" else "content"
    return reasoning, "".join(content), tail


class HarmonyToolParser(ToolParser):
    """`--tool-call-parser openai`: the calls among harmony messages; the content is the
    bodies of the messages that are neither calls nor reasoning."""

    def extract(self, text: str, final: bool) -> Extracted:
        found = Extracted("")
        messages, rest = _parse(text, final)
        for message in messages:
            if is_call(message):
                name = message.recipient.removeprefix("functions.")
                found.calls.append(DraftCall(name, message.body))
            elif message.channel != "analysis":
                found.content += message.body
        if messages and not rest and not messages[-1].end:
            last = messages[-1]
            found.tail = (
                "call" if is_call(last) else None if last.channel == "analysis" else "content"
            )
        return found
