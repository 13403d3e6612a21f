"""The Responses API's answer as it is built: finishing the response object, and the
typed events (`response.output_text.delta`, ...) a streamed answer is sent as,
translated from the chat path's chunks (server/serving_responses.py)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from server.responses_protocol import (
    FunctionCallItem,
    IncompleteDetails,
    MessageItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponseUsage,
)
from server.sse import SSEResponse


def finish(response: ResponseObject, status: str, usage: dict[str, Any] | None) -> None:
    response.status = status
    if status == "incomplete":
        response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
    if usage is not None:
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        response.usage = ResponseUsage(
            input_tokens=usage["prompt_tokens"],
            output_tokens=usage["completion_tokens"],
            total_tokens=usage["total_tokens"],
            input_tokens_details={"cached_tokens": cached},
        )


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class EventStream(StreamingResponse):
    """The events as SSE; the chat answer's request is aborted however this ends."""

    def __init__(self, answer: SSEResponse, events: AsyncIterator[str]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._answer = answer

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._answer.request_stream.abort()


class Events:
    """Chat chunks → the Responses API's events, one output item open at a time."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self.sequence = 0
        self.item: ReasoningItem | MessageItem | FunctionCallItem | None = None
        self.text = ""  # the open item's text or arguments so far
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    async def translate(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        snapshot = self.response.model_dump(mode="json", by_alias=True)
        yield self.event("response.created", response=snapshot)
        yield self.event("response.in_progress", response=snapshot)
        async for line in chunks:
            payload = line.removeprefix("data: ").strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:  # the chat stream failed midway
                yield self.event("error", **chunk["error"])
                return
            if chunk.get("usage"):
                self.usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                for event in self.delta(choice["delta"]):
                    yield event
                self.finish_reason = choice.get("finish_reason") or self.finish_reason
        for event in self.close():
            yield event
        status = "incomplete" if self.finish_reason == "length" else "completed"
        finish(self.response, status, self.usage)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        yield self.event(kind, response=self.response.model_dump(mode="json", by_alias=True))

    def delta(self, delta: dict[str, Any]) -> list[str]:
        events: list[str] = []
        if delta.get("reasoning_content"):
            events += self.extend("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self.extend("message", delta["content"])
        for piece in delta.get("tool_calls") or []:
            function = piece.get("function", {})
            if "id" in piece:  # a new call: its own item
                events += self.close()
                call = FunctionCallItem(
                    id=item_id("fc"),
                    status="in_progress",
                    call_id=piece["id"],
                    name=function["name"],
                    arguments="",
                )
                events += self.open(call)
            if function.get("arguments"):
                events += self.extend("function_call", function["arguments"])
        return events

    def open(self, item: ReasoningItem | MessageItem | FunctionCallItem) -> list[str]:
        self.item, self.text = item, ""
        where = {"output_index": len(self.response.output)}
        events = [self.event("response.output_item.added", **where, item=item.model_dump())]
        if not isinstance(item, FunctionCallItem):
            part = (
                ReasoningText(text="") if isinstance(item, ReasoningItem) else OutputText(text="")
            )
            events.append(
                self.event(
                    "response.content_part.added",
                    **where,
                    item_id=item.id,
                    content_index=0,
                    part=part.model_dump(),
                )
            )
        return events

    def extend(self, kind: str, text: str) -> list[str]:
        events: list[str] = []
        if self.item is None or self.item.type != kind:
            events += self.close()
            status = "in_progress"
            new = ReasoningItem if kind == "reasoning" else MessageItem
            events += self.open(
                new(id=item_id("rs" if kind == "reasoning" else "msg"), status=status, content=[])
            )
        self.text += text
        where = {"item_id": self.item.id, "output_index": len(self.response.output)}
        if kind == "function_call":
            return [
                *events,
                self.event("response.function_call_arguments.delta", **where, delta=text),
            ]
        name = "reasoning_text" if kind == "reasoning" else "output_text"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return [
            *events,
            self.event(f"response.{name}.delta", **where, content_index=0, delta=text, **extra),
        ]

    def close(self) -> list[str]:
        """Finish the open item and add it to the response's output."""
        item = self.item
        if item is None:
            return []
        self.item = None
        where = {"item_id": item.id, "output_index": len(self.response.output)}
        events: list[str] = []
        if isinstance(item, FunctionCallItem):
            item.arguments = self.text
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item.name,
                    arguments=self.text,
                )
            )
        else:
            reasoning = isinstance(item, ReasoningItem)
            part = ReasoningText(text=self.text) if reasoning else OutputText(text=self.text)
            item.content = [part]
            name = "reasoning_text" if reasoning else "output_text"
            extra = {} if reasoning else {"logprobs": []}
            events.append(
                self.event(
                    f"response.{name}.done", **where, content_index=0, text=self.text, **extra
                )
            )
            events.append(
                self.event(
                    "response.content_part.done", **where, content_index=0, part=part.model_dump()
                )
            )
        item.status = "incomplete" if self.finish_reason == "length" else "completed"
        events.append(
            self.event(
                "response.output_item.done",
                output_index=where["output_index"],
                item=item.model_dump(),
            )
        )
        self.response.output.append(item)
        return events
