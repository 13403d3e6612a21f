"""POST /v1/chat/completions: messages → chat template → engine → response or chunks."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response

from engine.request import TokenLogprob
from engine.sampling_params import MAX_LOGPROBS
from server import beam_search
from server.errors import APIError
from server.images import ChatPrompt
from server.parser_names import KEEPS_SPECIAL_TOKENS as TOOL_MARKERS
from server.prompts import template_message
from server.protocol import ChatCompletionRequest
from server.reasoning import KEEPS_SPECIAL_TOKENS, ReasoningStream, split
from server.replies import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatStreamChoice,
    ChatTokenLogprob,
    TopLogprob,
)
from server.request_stream import RequestStream
from server.serving import Serving, Usage, prompt_logprobs_out
from server.sse import SSEResponse
from server.structured import grammar_of
from server.tools import ToolPlan, ToolStream, plan_tools, tool_message


async def create_chat_completion(s: Serving, req: ChatCompletionRequest, raw: Request) -> Response:
    await s.admit(req.model)
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
    params = s.sampling_params(
        req, max_tokens, logprobs, req.prompt_logprobs, grammar_of(req, tools.grammar)
    )
    if req.use_beam_search:
        beam_search.check(req, params)
    if s.reasoning_parser in KEEPS_SPECIAL_TOKENS or s.tool_call_parser in TOOL_MARKERS:
        params.skip_special_tokens = False  # the parsers read markers that are special tokens
    truncate = s.truncation(req)
    prompts = s.prompts

    def prepare() -> ChatPrompt:
        prompt = prompts.render_chat(req.messages, req, tools.template_tools, fetched=fetched)
        if prompt.images is not None and truncate is not None:
            what = "truncate_prompt_tokens"
            raise APIError(f"{what} does not take images.", param=what)
        ids = prompt.token_ids = s.check_prompt(prompt.token_ids, params, "messages", truncate)
        if max_tokens is None and s.default_max_tokens is not None:
            # As vLLM: the model's default length, within the room the context leaves.
            room = s.max_model_len - len(ids)
            params.max_tokens = min(max(s.default_max_tokens, params.min_tokens), room)
        return prompt

    fetched = await prompts.fetch_images(raw, req.messages)  # no lane waits on a host
    size = sum(len(str(m.content or "")) for m in req.messages)
    prompt = await prompts.run(raw, size, prepare)  # ClientDisconnected: the app's 499
    prompt_ids = prompt.token_ids
    # vLLM's echo: an open assistant message is repeated at the head of the answer.
    last = req.messages[-1]
    echo = template_message(last)["content"] if req.echo and last.role == "assistant" else ""
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    if req.use_beam_search:
        stream = beam_search.beam_stream(
            s, raw, request_id, [prompt_ids], params, req.length_penalty, prompt.images
        )
    else:
        stream = s.async_engine.submit(request_id, [prompt_ids], params, prompt.images)
    created = int(time.time())
    if req.stream:
        chunks = _chunks(s, stream, req, tools, request_id, created, prompt_ids, echo)
        return SSEResponse(stream, chunks)

    usage = Usage()
    choices = []
    prompt_logprobs = None
    for out in sorted(await s.collect(raw, stream), key=lambda out: out.index):
        text, reasoning = echo + out.new_text, None
        if s.reasoning_parser is not None:
            found = split(s.reasoning_parser, text)
            text, reasoning = found.content, found.reasoning
        message, finish_reason = tool_message(tools, text, out.finish_reason)
        if reasoning is not None:
            message.reasoning_content = reasoning
            message.content = message.content or None  # all thinking: no answer text
        choices.append(
            ChatChoice(
                index=out.index,
                message=message,
                logprobs=_logprobs(s.token_names(req), out.new_logprobs or [])
                if req.logprobs
                else None,
                finish_reason=finish_reason,
                stop_reason=out.stop_reason,
                token_ids=out.new_token_ids if req.return_token_ids else None,
            )
        )
        if req.prompt_logprobs is not None and out.prompt_logprobs is not None:
            prompt_logprobs = prompt_logprobs_out(s, out.prompt_logprobs)
        usage.add(out)
    response = ChatCompletionResponse(
        id=request_id,
        created=created,
        model=s.answering(req.model),
        choices=choices,
        usage=usage.info(),
        prompt_token_ids=prompt_ids if req.return_token_ids else None,
        prompt_logprobs=prompt_logprobs,
    )
    return Response(response.model_dump_json(), media_type="application/json")


async def _chunks(
    s: Serving,
    stream: RequestStream,
    req: ChatCompletionRequest,
    tools: ToolPlan,
    request_id: str,
    created: int,
    prompt_ids: list[int],
    echo: str,
) -> AsyncIterator[str]:
    options = req.stream_options
    continuous = bool(options and options.continuous_usage_stats)
    usage = Usage()

    def chunk(choices: list[ChatStreamChoice], last: bool = False, **extra: object) -> str:
        return ChatCompletionChunk(
            id=request_id,
            created=created,
            model=s.answering(req.model),
            choices=choices,
            usage=usage.info() if continuous or last else None,
            **extra,
        ).model_dump_json()

    # OpenAI opens every choice with the role before any content (which stays null
    # in an answer that may be calls only).
    ids = {"prompt_token_ids": prompt_ids} if req.return_token_ids else {}
    # Per choice: its calls, as the text reveals them (None: plain content).
    calls = (
        [ToolStream(tools.parser(), tools.parallel) for _ in range(req.n)] if tools.parser else None
    )
    # Per choice: its reasoning, until </think> (None: no --reasoning-parser).
    parser = s.reasoning_parser
    thinking = [ReasoningStream(parser) for _ in range(req.n)] if parser else None

    def news(index: int, text: str, final: bool) -> dict:
        """The delta text brings a choice: reasoning, then content and calls."""
        delta: dict = {}
        if thinking is not None:
            delta, text = thinking[index].feed(text, final)
        if calls is None:
            return delta | ({"content": text} if text else {})
        return delta | calls[index].feed(text, final)

    for index in range(req.n):
        delta = {"role": "assistant"}
        if calls is None and thinking is None:
            delta["content"] = echo
        else:
            delta |= news(index, echo, False)
        yield chunk([ChatStreamChoice(index=index, delta=delta)], **ids)
    async for outputs in stream:
        for out in outputs:
            usage.add(out)
            logprobs = (
                _logprobs(s.token_names(req), out.new_logprobs or []) if req.logprobs else None
            )
            finish_reason = out.finish_reason if out.finished else None
            delta = news(out.index, out.new_text, out.finished)
            if calls is not None and out.finished:
                finish_reason = calls[out.index].finish_reason(finish_reason)
            if not (delta or out.finished or logprobs and logprobs.content):
                continue  # e.g. a token held back until its UTF-8 character completes
            choice = ChatStreamChoice(
                index=out.index,
                delta=delta,
                logprobs=logprobs,
                finish_reason=finish_reason,
                stop_reason=out.stop_reason if out.finished else None,
                token_ids=out.new_token_ids if req.return_token_ids else None,
            )
            yield chunk([choice])
    if options and options.include_usage:
        yield chunk([], last=True)


def _logprobs(name: Callable[[int], str], logprobs: list[TokenLogprob]) -> ChatChoiceLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        token = name(token_id)
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))

    content = []
    for lp in logprobs:
        sampled = top(lp.token_id, lp.logprob)
        content.append(
            ChatTokenLogprob(**sampled.model_dump(), top_logprobs=[top(t, v) for t, v in lp.top])
        )
    return ChatChoiceLogprobs(content=content)
