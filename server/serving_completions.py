"""POST /v1/completions: prompts → engine → one response or a stream of chunks."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from engine.request import TokenLogprob
from server.async_engine import RequestStream
from server.errors import APIError
from server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from server.serving import (
    ClientDisconnected,
    Serving,
    Usage,
    disconnected_response,
)
from server.structured import grammar_of


async def create_completion(s: Serving, req: CompletionRequest, raw: Request) -> Response:
    s.check_model(req.model)
    if req.suffix:
        raise APIError("suffix is not supported.", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError("best_of other than n is not supported.", param="best_of")
    if req.echo and req.logprobs is not None:
        raise APIError("echo together with logprobs is not supported.", param="echo")
    prompts = _prompt_list(req.prompt)
    params = s.sampling_params(req, req.max_tokens, req.logprobs, grammar_of(req))

    def prepare() -> tuple[list[list[int]], list[str]]:
        ids = [s.encode(p) if isinstance(p, str) else p for p in prompts]
        for one in ids:
            s.check_prompt(one, params, "prompt")
        if not req.echo:
            return ids, [""] * len(prompts)
        return ids, [p if isinstance(p, str) else s.tokenizer.decode(p) for p in prompts]

    # Token-id prompts need no tokenizer: checking them inline saves the executor's
    # round trip (a thread wake and two GIL hand-offs) per request.
    needs_tokenizer = req.echo or any(isinstance(p, str) for p in prompts)
    prompt_ids, echoes = await s.run(prepare) if needs_tokenizer else prepare()
    request_id = f"cmpl-{uuid.uuid4().hex}"
    stream = s.async_engine.submit(request_id, prompt_ids, params)
    # A choice's index in the response: prompt-major, then choice (as OpenAI numbers them).
    position = {rid: i for i, rid in enumerate(stream.request_ids)}
    created = int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunks = _chunks(s, stream, req, request_id, created, position, echoes, include_usage)
        return s.sse(stream, chunks)

    try:
        states = await s.collect(raw, stream)
    except ClientDisconnected:
        return disconnected_response()
    usage = Usage()
    choices = []
    for (rid, index), state in sorted(
        states.items(), key=lambda kv: (position[kv[0][0]], kv[0][1])
    ):
        echo = echoes[position[rid]]
        logprobs = None
        if req.logprobs is not None:
            logprobs = CompletionLogprobs()
            _extend_logprobs(s, logprobs, state.logprobs, len(echo))
        choices.append(
            CompletionChoice(
                index=position[rid] * req.n + index,
                text=echo + state.text,
                logprobs=logprobs,
                finish_reason=state.finish_reason,
                stop_reason=state.stop_reason,
            )
        )
        usage.record(rid, index, state.num_prompt_tokens, state.num_output_tokens)
    response = CompletionResponse(
        id=request_id, created=created, model=s.model_name, choices=choices, usage=usage.info()
    )
    return Response(response.model_dump_json(), media_type="application/json")


async def _chunks(
    s: Serving,
    stream: RequestStream,
    req: CompletionRequest,
    request_id: str,
    created: int,
    position: dict[str, int],
    echoes: list[str],
    include_usage: bool,
) -> AsyncIterator[str]:
    def chunk(choices: list[CompletionChoice]) -> str:
        return CompletionResponse(
            id=request_id, created=created, model=s.model_name, choices=choices
        ).model_dump_json()

    text_chunk = TextChunks(request_id, created, s.model_name)

    # text_offset runs on across chunks, from the end of the echoed prompt.
    offsets = {(rid, i): len(echoes[p]) for rid, p in position.items() for i in range(req.n)}
    for p in position.values():
        for i in range(req.n):
            if echoes[p]:
                yield chunk([CompletionChoice(index=p * req.n + i, text=echoes[p])])
    usage = Usage()
    async for outputs in stream:
        for out in outputs:
            usage.add(out)
            key = (out.request_id, out.index)
            logprobs = None
            if req.logprobs is not None:
                logprobs = CompletionLogprobs()
                offsets[key] = _extend_logprobs(s, logprobs, out.new_logprobs or [], offsets[key])
            if not (out.new_text or out.finished or logprobs and logprobs.tokens):
                continue  # e.g. a token held back until its UTF-8 character completes
            if logprobs is None:
                yield text_chunk(
                    position[out.request_id] * req.n + out.index,
                    out.new_text,
                    out.finish_reason if out.finished else None,
                    out.stop_reason if out.finished else None,
                )
                continue
            yield chunk(
                [
                    CompletionChoice(
                        index=position[out.request_id] * req.n + out.index,
                        text=out.new_text,
                        logprobs=logprobs,
                        finish_reason=out.finish_reason if out.finished else None,
                        stop_reason=out.stop_reason if out.finished else None,
                    )
                ]
            )
    if include_usage:
        yield CompletionResponse(
            id=request_id, created=created, model=s.model_name, choices=[], usage=usage.info()
        ).model_dump_json()


class TextChunks:
    """The common chunk (one choice, no logprobs) as CompletionResponse.model_dump_json()
    writes it, from a template: built once per token batch per stream, it is the
    server's hottest path, and two pydantic models per chunk cost several times more."""

    def __init__(self, request_id: str, created: int, model: str) -> None:
        empty = CompletionResponse(
            id=request_id, created=created, model=model, choices=[]
        ).model_dump_json()
        cut = empty.index('"choices":[]') + len('"choices":[')
        self._head, self._tail = empty[:cut], empty[cut:]

    def __call__(
        self, index: int, text: str, finish_reason: str | None, stop_reason: int | str | None
    ) -> str:
        return (
            f'{self._head}{{"index":{index},"text":{_json(text)},"logprobs":null,'
            f'"finish_reason":{_json(finish_reason)},"stop_reason":{_json(stop_reason)}}}'
            f"{self._tail}"
        )


def _json(value: str | int | None) -> str:
    # As pydantic writes it: UTF-8 kept as is, not \u-escaped.
    return json.dumps(value, ensure_ascii=False)


def _prompt_list(prompt: str | list) -> list[str | list[int]]:
    """OpenAI's four prompt shapes → a list of prompts, each text or token ids."""
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise APIError("The prompt is empty.", param="prompt")
    return prompts


def _extend_logprobs(
    s: Serving, into: CompletionLogprobs, logprobs: list[TokenLogprob], offset: int
) -> int:
    """Append tokens in the legacy format; returns the text offset after them."""
    for lp in logprobs:
        token = s.token_text(lp.token_id)
        into.tokens.append(token)
        into.token_logprobs.append(lp.logprob)
        into.top_logprobs.append({s.token_text(t): v for t, v in lp.top})
        into.text_offset.append(offset)
        offset += len(token)
    return offset
