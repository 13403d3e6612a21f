"""Tool calling on /v1/chat/completions: what `tools` and `tool_choice` ask of a
request (`plan_tools`), and the calls in its output, whole (`tool_message`) or
streamed (`ToolStream`).

    none      tools are not shown to the model; its output is content
    auto      tools are rendered by the chat template, and the server's parser
              (--tool-call-parser, with --enable-auto-tool-choice) finds calls
    required  a grammar makes the output a JSON array of calls, each naming a
              tool and giving arguments valid under its parameters schema
              (one call unless parallel_tool_calls)
    {"type": "function", "function": {"name"}}  a grammar makes the output that
              function's arguments
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.structured.spec import GrammarSpec
from server.errors import APIError
from server.parser_names import PARSERS
from server.protocol import ChatCompletionRequest, FunctionCall, ToolCall
from server.replies import AssistantMessage
from server.structured import field_spec
from server.tool_parsers import NamedParser, RequiredParser, ToolParser

NO_ARGUMENTS = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    template_tools: list[dict] | None = None  # for the chat template's `tools`
    grammar: tuple[str, GrammarSpec] | None = None  # (the field it comes from, spec)
    parser: Callable[[], ToolParser] | None = None  # None: the output is plain content
    parallel: bool = True


def plan_tools(req: ChatCompletionRequest, auto_parser: str | None) -> ToolPlan:
    """auto_parser: the server's --tool-call-parser, None without --enable-auto-tool-choice."""
    tools = req.tools or []
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if not tools:
        if choice != "none":
            raise APIError("tool_choice needs tools.", param="tool_choice")
        return ToolPlan()
    by_name = {tool.function.name: tool.function for tool in tools}
    if len(by_name) != len(tools):
        raise APIError("Tool names must be unique.", param="tools")
    if choice == "none":
        return ToolPlan()
    template_tools = [tool.model_dump(exclude_none=True) for tool in tools]
    parallel = req.parallel_tool_calls
    if choice == "auto":
        if auto_parser is None:
            raise APIError(
                '"auto" tool choice needs the server started with --enable-auto-tool-choice '
                "and --tool-call-parser.",
                param="tool_choice",
            )
        parser = PARSERS[auto_parser]
        if getattr(parser, "READS_SCHEMAS", False):  # types the arguments by the functions'
            parser = functools.partial(parser, by_name)
        return ToolPlan(template_tools, None, parser, parallel)
    if choice == "required":
        schema, parser = _calls_schema(by_name, parallel), RequiredParser
    else:
        name = choice.function.name
        if name not in by_name:
            raise APIError(
                f"tool_choice names {name!r}, which is not among the tools.", param="tool_choice"
            )
        schema, parser = by_name[name].parameters or NO_ARGUMENTS, lambda: NamedParser(name)
    grammar = field_spec("tools", GrammarSpec.json_schema, schema)
    return ToolPlan(template_tools, grammar, parser, parallel)


def _calls_schema(functions: dict, parallel: bool) -> dict[str, Any]:
    """A JSON array of calls: each names one function and gives its parameters."""
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": name},
                    "parameters": function.parameters or NO_ARGUMENTS,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, function in functions.items()
        ]
    }
    return {"type": "array", "items": call, "minItems": 1} | ({} if parallel else {"maxItems": 1})


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_message(
    plan: ToolPlan, text: str, finish_reason: str | None
) -> tuple[AssistantMessage, str | None]:
    if plan.parser is None:
        return AssistantMessage(content=text), finish_reason
    found = plan.parser().extract(text, final=True)
    calls = found.calls if plan.parallel else found.calls[:1]
    content = found.content if found.content.strip() or not calls else None
    tool_calls = [
        ToolCall(id=call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in calls
    ]
    return AssistantMessage(content=content, tool_calls=tool_calls), _finish(calls, finish_reason)


def _finish(calls: list, finish_reason: str | None) -> str | None:
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


@dataclass
class ToolStream:
    """One streamed choice: what each new piece of text adds to its content and calls,
    as OpenAI's delta fields."""

    parser: ToolParser
    parallel: bool = True
    text: str = ""
    content_sent: int = 0
    arguments_sent: list[int] = field(default_factory=list)  # per call begun: the length sent
    tail: str | None = None  # what a piece without the parser's MARK extends, if sent so

    def feed(self, new_text: str, final: bool) -> dict[str, Any]:
        """The delta for new_text (final: the choice's last): `content` and/or
        `tool_calls`, each present only if it has news."""
        self.text += new_text
        if self.tail is not None and not final and self.parser.MARK not in new_text and new_text:
            # The text is not parsed again (its whole length on every token): the piece
            # extends the content, or the last call's arguments, as sent so far.
            if self.tail == "string" and ('"' in new_text or "\\" in new_text):
                return self._parse(final)  # it may close the string
            if self.tail == "held":
                return {}
            if self.tail == "content":
                self.content_sent += len(new_text)
                return {"content": new_text}
            self.arguments_sent[-1] += len(new_text)
            index = len(self.arguments_sent) - 1
            return {"tool_calls": [{"index": index, "function": {"arguments": new_text}}]}
        return self._parse(final)

    def _parse(self, final: bool) -> dict[str, Any]:
        found = self.parser.extract(self.text, final)
        calls = found.calls if self.parallel else found.calls[:1]
        content = found.content
        if not content.strip() and (calls or not final):
            content = ""  # whitespace around calls is no content; before them, not yet
        delta: dict[str, Any] = {}
        if len(content) > self.content_sent:
            delta["content"] = content[self.content_sent :]
            self.content_sent = len(content)
        pieces = []
        for index, call in enumerate(calls):
            if index == len(self.arguments_sent):  # a new call: its id and name first
                self.arguments_sent.append(len(call.arguments))
                pieces.append(
                    {
                        "index": index,
                        "id": call_id(),
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                )
            elif len(call.arguments) > self.arguments_sent[index]:
                fragment = call.arguments[self.arguments_sent[index] :]
                self.arguments_sent[index] = len(call.arguments)
                pieces.append({"index": index, "function": {"arguments": fragment}})
        if pieces:
            delta["tool_calls"] = pieces
        # Content extends only once sent (whitespace is held back), a call's arguments
        # only when the call is the last one sent.
        if found.tail == "content" and self.content_sent:
            self.tail = "content"
        elif found.tail in ("call", "string", "held") and calls and len(calls) == len(found.calls):
            self.tail = found.tail
        else:
            self.tail = None
        return delta

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return _finish(self.arguments_sent, finish_reason)
