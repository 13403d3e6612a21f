"""The tool-call parsers of calls written as a name and key/value pairs (GLM-4.5's,
Qwen3-Coder's, MiniMax-M2's), each value typed by the function's schema."""

from __future__ import annotations

import json
import re
from typing import Any

from server.tool_parsers import DraftCall, Extracted, ToolParser, before_any_call


class PairsParser(ToolParser):
    """Calls written as a name and key/value pairs inside <tool_call> ... </tool_call>,
    made a JSON object pair by pair as each value closes (its brace once the call has).
    A value is a string where the function's schema says the parameter is one, else JSON
    where it reads as JSON (vLLM's rule); content is the text before the first call."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    PAIR: re.Pattern[str]
    READS_SCHEMAS = True  # plan_tools passes the request's functions

    def __init__(self, functions: dict[str, Any] | None = None) -> None:
        self.functions = functions or {}  # name -> FunctionDefinition

    def name_end(self, body: str, closed: bool) -> tuple[str, int] | None:
        """The call's name and where its pairs start; None while it may be arriving."""
        raise NotImplementedError

    def clean(self, value: str) -> str:
        return value.strip()

    def extract(self, text: str, final: bool) -> Extracted:
        start = text.find(self.OPEN)
        if start < 0:
            return before_any_call(text, self.OPEN, final)
        calls: list[DraftCall] = []
        pos, tail = start, None
        while pos >= 0:
            body_start = pos + len(self.OPEN)
            end = text.find(self.CLOSE, body_start)
            body = text[body_start : len(text) if end < 0 else end]
            named = self.name_end(body, end >= 0)
            if named is None:
                break
            name, rest = named
            if name:
                calls.append(DraftCall(name, self._arguments(name, body[rest:], end >= 0)))
            if end < 0:
                # Named, and open: its arguments change only as a tag closes a value.
                tail = "held" if name else None
                break
            pos = text.find(self.OPEN, end + len(self.CLOSE))
        if final and not calls:
            return Extracted(text)
        return Extracted(text[:start], calls, tail)

    def _arguments(self, name: str, body: str, closed: bool) -> str:
        pairs = []
        for key, value in self.PAIR.findall(body):
            typed = self._value(name, key.strip(), self.clean(value))
            pairs.append(f"{json.dumps(key.strip())}: {json.dumps(typed)}")
        return "{" + ", ".join(pairs) + ("}" if closed else "")

    def _value(self, name: str, key: str, value: str) -> Any:
        function = self.functions.get(name)
        schema = ((function.parameters if function else None) or {}).get("properties", {})
        if (schema.get(key) or {}).get("type") == "string":
            return value
        try:
            return json.loads(value)
        except ValueError:
            return value


class Glm45Parser(PairsParser):
    """GLM-4.5's: the name, then <arg_key>K</arg_key><arg_value>V</arg_value> pairs."""

    KEY = "<arg_key>"
    PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def name_end(self, body: str, closed: bool) -> tuple[str, int] | None:
        ends = [i for i in (body.find("\n"), body.find(self.KEY)) if i >= 0]
        end = min(ends) if ends else (len(body) if closed else -1)
        return None if end < 0 else (body[:end].strip(), end)


class Qwen3CoderParser(PairsParser):
    """Qwen3-Coder's: <function=NAME>, then <parameter=K>V</parameter> pairs, each value
    on lines of its own (one newline before and after it is not the value's)."""

    FUNCTION = re.compile(r"<function=([^>\n]*)>")
    PAIR = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.S)

    def name_end(self, body: str, closed: bool) -> tuple[str, int] | None:
        match = self.FUNCTION.search(body)
        if match is None:
            return ("", len(body)) if closed else None
        return match[1].strip(), match.end()

    def clean(self, value: str) -> str:
        return value.removeprefix("\n").removesuffix("\n")


class MiniMaxM2Parser(PairsParser):
    """MiniMax-M2's: <minimax:tool_call>, then each call an <invoke name="NAME"> holding
    <parameter name="K">V</parameter> pairs, to </invoke>; content is the text before
    the block."""

    BLOCK = "<minimax:tool_call>"
    OPEN, CLOSE = "<invoke name=", "</invoke>"
    NAME = re.compile(r'\s*"([^"\n]*)"\s*>')
    PAIR = re.compile(r'<parameter name="([^"\n]*)">(.*?)</parameter>', re.S)

    def name_end(self, body: str, closed: bool) -> tuple[str, int] | None:
        match = self.NAME.match(body)
        if match is None:
            return ("", len(body)) if closed else None
        return match[1].strip(), match.end()

    def extract(self, text: str, final: bool) -> Extracted:
        block = text.find(self.BLOCK)
        if block < 0:
            return before_any_call(text, self.BLOCK, final)
        inner = super().extract(text[block:], final)
        if not inner.calls:  # the block open, no call in it yet (at the end: the answer)
            return Extracted(text) if final else Extracted(text[:block])
        return Extracted(text[:block], inner.calls, inner.tail)
