"""POST /v1/responses: OpenAI's Responses API, served by the chat path.

A request becomes a chat request (`instructions` the system message, `input` items the
messages: a function call the assistant's tool call, its output a tool message, a
reasoning item the next assistant message's `reasoning_content`) and runs as one, with
the server's reasoning and tool-call parsers. Its answer comes back as output items,
reasoning, then the message, then function calls; streamed, as the Responses API's
typed events (`response.output_text.delta`, ...), translated from the chat chunks
(server/responses_events.py). Responses are not stored, so `previous_response_id` is
refused: send the whole conversation in `input`, as with `store: false`.
"""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from server.errors import APIError
from server.protocol import ChatCompletionRequest
from server.responses_events import Events, EventStream, finish, item_id
from server.responses_protocol import (
    FunctionCallItem,
    InputContentPart,
    InputImagePart,
    InputItem,
    MessageItem,
    OutputText,
    ReasoningItem,
    ReasoningPart,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    TextFormat,
    TextOptions,
)
from server.serving import Serving
from server.serving_chat import create_chat_completion
from server.sse import SSEResponse

# The chat request's fields, named as the Responses request names them (for errors).
_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "response_format.json_schema": "text.format",
    "reasoning_effort": "reasoning.effort",
}


async def create_response(s: Serving, req: ResponsesRequest, raw: Request) -> Response:
    if req.previous_response_id is not None:
        raise APIError(
            "previous_response_id is not supported: responses are not stored. Send the "
            "conversation in input.",
            param="previous_response_id",
        )
    try:
        chat = ChatCompletionRequest.model_validate(_chat_fields(req))
    except ValidationError as exc:
        raise APIError(f"input: {exc.errors()[0]['msg']}", param="input") from None
    try:
        answer = await create_chat_completion(s, chat, raw)
    except APIError as exc:
        exc.param = _PARAMS.get(exc.param or "", exc.param)
        raise
    base = _response(s, req, item_id("resp"))
    if isinstance(answer, SSEResponse):
        return EventStream(answer, Events(base).translate(answer.body_iterator))
    body = json.loads(answer.body)
    choice = body["choices"][0]
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    base.output = _items(choice["message"], status)
    finish(base, status, body["usage"])
    return Response(base.model_dump_json(by_alias=True), media_type="application/json")


def _chat_fields(req: ResponsesRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {"messages": _messages(req), "stream": req.stream}
    if req.stream:
        fields["stream_options"] = {"include_usage": True}
    for name, value in (
        ("model", req.model),
        ("max_tokens", req.max_output_tokens),
        ("temperature", req.temperature),
        ("top_p", req.top_p),
    ):
        if value is not None:
            fields[name] = value
    if req.tools:
        fields["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in req.tools
        ]
        fields["parallel_tool_calls"] = req.parallel_tool_calls
    if req.tool_choice is not None:
        choice = req.tool_choice
        fields["tool_choice"] = (
            choice
            if isinstance(choice, str)
            else {"type": "function", "function": {"name": choice.name}}
        )
    if req.reasoning is not None and req.reasoning.effort is not None:
        fields["reasoning_effort"] = req.reasoning.effort
    form = req.text.format if req.text is not None else None
    if form is not None and form.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    elif form is not None and form.type == "json_schema":
        if form.name is None or form.schema_ is None:
            raise APIError("A json_schema format needs a name and a schema.", param="text.format")
        spec = {"name": form.name, "schema": form.schema_, "strict": form.strict}
        fields["response_format"] = {"type": "json_schema", "json_schema": spec}
    return fields


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages `instructions` and `input` make."""
    messages: list[dict[str, Any]] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    reasoning: str | None = None  # a reasoning item's text, for the next assistant turn
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if item.type == "reasoning":
            parts = item.content or item.summary or []
            if any(isinstance(part, InputImagePart) for part in parts):
                raise APIError("A reasoning item's parts must be text.", param=where)
            text = parts if isinstance(parts, str) else "".join(part.text for part in parts)
            reasoning = (reasoning or "") + text
        elif item.type == "message":
            if item.role is None or item.content is None:
                raise APIError("A message item needs a role and content.", param=where)
            message: dict[str, Any] = {"role": item.role, "content": _content(item, where)}
            if item.role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif item.type == "function_call":
            if item.call_id is None or item.name is None or item.arguments is None:
                raise APIError("A function_call needs call_id, name and arguments.", param=where)
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)  # the turn it belongs to
            else:
                turn = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    turn["reasoning_content"], reasoning = reasoning, None
                messages.append(turn)
        else:  # function_call_output
            if item.call_id is None or item.output is None:
                raise APIError("A function_call_output needs call_id and output.", param=where)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    if not messages:
        raise APIError("input must hold a message.", param="input")
    return messages


def _content(item: InputItem, where: str) -> str | list[dict[str, Any]]:
    """A message item's content as a chat message's: its text, or chat content parts
    where it holds images."""
    content = item.content
    if isinstance(content, str):
        return content
    if any(isinstance(part, ReasoningPart) for part in content):
        raise APIError("A message's parts must be text or images.", param=where)
    if not any(isinstance(part, InputImagePart) for part in content):
        return "".join(part.text for part in content)
    parts: list[dict[str, Any]] = []
    for part in content:
        if isinstance(part, InputContentPart):
            parts.append({"type": "text", "text": part.text})
        elif part.image_url is None:
            raise APIError("An input_image needs its image_url (file_id is not served).",
                           param=where)  # fmt: skip
        else:
            parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
    return parts


def _response(s: Serving, req: ResponsesRequest, response_id: str) -> ResponseObject:
    """The response as it starts: the request's settings echoed, no output yet."""
    text = req.text or TextOptions(format=TextFormat(type="text"))
    return ResponseObject(
        id=response_id,
        created_at=int(time.time()),
        model=s.answering(req.model),
        status="in_progress",
        output=[],
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        tools=req.tools or [],
        tool_choice=req.tool_choice or ("auto" if req.tools else "none"),
        parallel_tool_calls=req.parallel_tool_calls,
        reasoning=req.reasoning,
        text=text,
        metadata=req.metadata or {},
    )


def _items(message: dict[str, Any], status: str) -> list:
    """A chat answer's message as output items: reasoning, text, then calls."""
    items: list = []
    if message.get("reasoning_content") is not None:
        text = [ReasoningText(text=message["reasoning_content"])]
        items.append(ReasoningItem(id=item_id("rs"), status=status, content=text))
    if message.get("content"):
        text = [OutputText(text=message["content"])]
        items.append(MessageItem(id=item_id("msg"), status=status, content=text))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        items.append(
            FunctionCallItem(
                id=item_id("fc"),
                status="completed",
                call_id=call["id"],
                name=function["name"],
                arguments=function["arguments"],
            )
        )
    return items
