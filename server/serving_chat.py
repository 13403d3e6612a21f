"""POST /v1/chat/completions: messages → chat template → engine → response or chunks."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from engine.request import TokenLogprob
from engine.sampling_params import MAX_LOGPROBS
from server.async_engine import RequestStream
from server.errors import APIError
from server.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    ChatTokenLogprob,
    TopLogprob,
)
from server.serving import ClientDisconnected, Serving, Usage, disconnected_response
from server.structured import grammar_of
from server.tools import ToolPlan, ToolStream, plan_tools, tool_message


async def create_chat_completion(s: Serving, req: ChatCompletionRequest, raw: Request) -> Response:
    s.check_model(req.model)
    if not req.messages:
        raise APIError("messages must not be empty.", param="messages")
    tools = plan_tools(req, s.tool_call_parser)
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise APIError("top_logprobs requires logprobs to be true.", param="top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise APIError(
                f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}.",
                param="top_logprobs",
            )
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = s.sampling_params(req, max_tokens, logprobs, grammar_of(req, tools.grammar))

    def prepare() -> list[int]:
        ids = s.render_chat(req.messages, True, tools.template_tools)
        s.check_prompt(ids, params, "messages")
        return ids

    prompt_ids = await s.run(prepare)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    stream = s.async_engine.submit(request_id, [prompt_ids], params)
    created = int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunks = _chunks(s, stream, req, tools, request_id, created, include_usage)
        return s.sse(stream, chunks)

    try:
        states = await s.collect(raw, stream)
    except ClientDisconnected:
        return disconnected_response()
    usage = Usage()
    choices = []
    for (rid, index), state in sorted(states.items(), key=lambda kv: kv[0][1]):
        message, finish_reason = tool_message(tools, state.text, state.finish_reason)
        choices.append(
            ChatChoice(
                index=index,
                message=message,
                logprobs=_logprobs(s, state.logprobs) if req.logprobs else None,
                finish_reason=finish_reason,
                stop_reason=state.stop_reason,
            )
        )
        usage.record(rid, index, state.num_prompt_tokens, state.num_output_tokens)
    response = ChatCompletionResponse(
        id=request_id, created=created, model=s.model_name, choices=choices, usage=usage.info()
    )
    return Response(response.model_dump_json(), media_type="application/json")


async def _chunks(
    s: Serving,
    stream: RequestStream,
    req: ChatCompletionRequest,
    tools: ToolPlan,
    request_id: str,
    created: int,
    include_usage: bool,
) -> AsyncIterator[str]:
    def chunk(choice: ChatStreamChoice) -> str:
        return ChatCompletionChunk(
            id=request_id, created=created, model=s.model_name, choices=[choice]
        ).model_dump_json()

    # OpenAI opens every choice with the role before any content (which stays null
    # in an answer that may be calls only).
    opening = {"role": "assistant"} if tools.parser else {"role": "assistant", "content": ""}
    for index in range(req.n):
        yield chunk(ChatStreamChoice(index=index, delta=opening))
    usage = Usage()
    # Per choice: its calls, as the text reveals them (None: plain content).
    calls = (
        [ToolStream(tools.parser(), tools.parallel) for _ in range(req.n)] if tools.parser else None
    )
    async for outputs in stream:
        for out in outputs:
            usage.add(out)
            logprobs = _logprobs(s, out.new_logprobs or []) if req.logprobs else None
            finish_reason = out.finish_reason if out.finished else None
            if calls is None:
                delta = {"content": out.new_text} if out.new_text else {}
            else:
                delta = calls[out.index].feed(out.new_text, out.finished)
                if out.finished:
                    finish_reason = calls[out.index].finish_reason(finish_reason)
            if not (delta or out.finished or logprobs and logprobs.content):
                continue  # e.g. a token held back until its UTF-8 character completes
            yield chunk(
                ChatStreamChoice(
                    index=out.index,
                    delta=delta,
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    stop_reason=out.stop_reason if out.finished else None,
                )
            )
    if include_usage:
        yield ChatCompletionChunk(
            id=request_id, created=created, model=s.model_name, choices=[], usage=usage.info()
        ).model_dump_json()


def _logprobs(s: Serving, logprobs: list[TokenLogprob]) -> ChatChoiceLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        token = s.token_text(token_id)
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))

    content = []
    for lp in logprobs:
        sampled = top(lp.token_id, lp.logprob)
        content.append(
            ChatTokenLogprob(**sampled.model_dump(), top_logprobs=[top(t, v) for t, v in lp.top])
        )
    return ChatChoiceLogprobs(content=content)
