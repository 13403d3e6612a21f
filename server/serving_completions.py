"""POST /v1/completions: prompts → engine → one response or a stream of chunks."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from itertools import repeat

from fastapi import Request
from fastapi.responses import Response

from engine.request import RequestOutput, TokenLogprob
from server import beam_search
from server.errors import APIError
from server.prompts import prompt_list
from server.protocol import CompletionRequest
from server.replies import CompletionChoice, CompletionLogprobs, CompletionResponse
from server.request_stream import RequestStream
from server.serving import Serving, Usage, prompt_logprobs_out
from server.sse import SSEResponse
from server.structured import grammar_of


@dataclass
class Prompt:
    """One prompt of the request, as the engine gets it and as echo shows it."""

    token_ids: list[int]
    echo: str  # "" unless echo


async def create_completion(s: Serving, req: CompletionRequest, raw: Request) -> Response:
    await s.admit(req.model)
    if req.suffix:
        raise APIError("suffix is not supported.", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError("best_of other than n is not supported.", param="best_of")
    texts = prompt_list(req.prompt, "prompt")
    # echo with max_tokens 0 scores the prompt only: one token is generated and dropped.
    score_only = req.echo and req.max_tokens == 0
    max_tokens = 1 if score_only else req.max_tokens
    # echo + logprobs: the prompt's tokens come with their logprobs too (scoring).
    prompt_logprobs = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, req.logprobs)
    params = s.sampling_params(req, max_tokens, req.logprobs, prompt_logprobs, grammar_of(req))
    if req.use_beam_search:
        beam_search.check(req, params)
    truncate = s.truncation(req)
    prompts_ = s.prompts

    def prepare() -> list[Prompt]:
        out = []
        for text in texts:
            ids = s.prompt_ids(text, params, "prompt", truncate, req.add_special_tokens)
            echo = ""
            if req.echo:
                keep = isinstance(text, str) and truncate is None
                echo = text if keep else prompts_.decode(ids)
            out.append(Prompt(ids, echo))
        return out

    # Token-id prompts need no tokenizer (unless for bad words): checking them inline
    # saves the executor's round trip (a thread wake and two GIL hand-offs) per request.
    text_chars = sum(len(t) for t in texts if isinstance(t, str))
    if req.echo or text_chars or params.bad_words:
        prompts = await prompts_.run(raw, text_chars, prepare)  # ClientDisconnected: the app's 499
    else:
        prompts = prepare()
    request_id = f"cmpl-{uuid.uuid4().hex}"
    ids = [p.token_ids for p in prompts]
    if req.use_beam_search:
        stream = beam_search.beam_stream(s, raw, request_id, ids, params, req.length_penalty)
    else:
        stream = s.async_engine.submit(request_id, ids, params)
    answer = _Answer(s, req, request_id, stream, prompts, score_only)
    if req.stream:
        return SSEResponse(stream, answer.chunks())
    outputs = await s.collect(raw, stream)
    return Response(answer.response(outputs).model_dump_json(), media_type="application/json")


@dataclass
class _Answer:
    """Builds the response, or the stream of chunks, from the engine's outputs."""

    s: Serving
    req: CompletionRequest
    request_id: str
    stream: RequestStream
    prompts: list[Prompt]
    score_only: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        # A choice's index in the response: prompt-major, then choice (as OpenAI numbers them).
        self.position = {rid: i for i, rid in enumerate(self.stream.request_ids)}
        self.name = self.s.token_names(self.req)  # how logprobs name a token

    def index(self, rid: str, choice: int) -> int:
        return self.position[rid] * self.req.n + choice

    def response(self, outputs: list[RequestOutput]) -> CompletionResponse:
        req, s = self.req, self.s
        usage = Usage()
        choices = []
        for out in sorted(outputs, key=lambda out: self.index(out.request_id, out.index)):
            prompt = self.prompts[self.position[out.request_id]]
            if self.score_only:  # the one token generated for it is not the answer
                out.new_text, out.new_token_ids, out.new_logprobs = "", [], []
                out.num_output_tokens, out.finish_reason = 0, "length"
            choice = CompletionChoice(
                index=self.index(out.request_id, out.index),
                text=prompt.echo + out.new_text,
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
            )
            if req.logprobs is not None:
                choice.logprobs = into = CompletionLogprobs()
                offset = 0
                if req.echo:
                    offset = _extend_logprobs(self.name, into, _echoed(prompt, out))
                _extend_logprobs(self.name, into, _sampled(out), offset, req.logprobs)
            self._extras(choice, prompt, out.new_token_ids, out.prompt_logprobs)
            choices.append(choice)
            usage.add(out)
        return CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=s.answering(req.model),
            choices=choices,
            usage=usage.info(),
        )

    def _extras(
        self,
        choice: CompletionChoice,
        prompt: Prompt | None,
        token_ids: list[int],
        prompt_logprobs: list[TokenLogprob | None] | None,
    ) -> None:
        if self.req.return_token_ids:
            choice.token_ids = token_ids
            if prompt is not None:
                choice.prompt_token_ids = prompt.token_ids
        if self.req.prompt_logprobs is not None and prompt_logprobs is not None:
            choice.prompt_logprobs = prompt_logprobs_out(self.s, prompt_logprobs)

    async def chunks(self) -> AsyncIterator[str]:
        req, s = self.req, self.s
        options = req.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(options and options.continuous_usage_stats)
        usage = Usage()

        def chunk(choices: list[CompletionChoice], last: bool = False) -> str:
            return CompletionResponse(
                id=self.request_id,
                created=self.created,
                model=s.answering(req.model),
                choices=choices,
                usage=usage.info() if continuous or last else None,
            ).model_dump_json()

        text_chunk = TextChunks(self.request_id, self.created, s.answering(req.model))
        plain = not (continuous or req.return_token_ids or req.prompt_logprobs is not None)
        offsets = {
            (rid, i): len(self.prompts[p].echo) for rid, p in self.position.items()
            for i in range(req.n)
        }  # fmt: skip
        first = {(rid, i) for rid in self.position for i in range(req.n)}  # not yet opened
        # The echoed prompt opens each choice: a chunk of its own, or with logprobs (whose
        # prompt part comes with the engine's first output) the first output's chunk.
        if req.echo and req.logprobs is None:
            for rid, p in self.position.items():
                for i in range(req.n):
                    yield text_chunk(self.index(rid, i), self.prompts[p].echo, None, None)
        async for outputs in self.stream:
            for out in outputs:
                usage.add(out)
                key = (out.request_id, out.index)
                prompt = self.prompts[self.position[out.request_id]]
                opening = key in first
                text, token_ids = out.new_text, out.new_token_ids
                if self.score_only:
                    text, token_ids = "", []
                logprobs = None
                if req.logprobs is not None:
                    logprobs = CompletionLogprobs()
                    # The echoed prompt opens the choice's first chunk (never a skipped
                    # or plain one).
                    if opening and req.echo:
                        _extend_logprobs(self.name, logprobs, _echoed(prompt, out))
                        text = prompt.echo + text
                    if not self.score_only:
                        offsets[key] = _extend_logprobs(
                            self.name, logprobs, _sampled(out), offsets[key], req.logprobs
                        )
                finish = out.finish_reason if out.finished else None
                if self.score_only and out.finished:
                    finish = "length"
                if not (text or out.finished or logprobs and logprobs.tokens):
                    continue  # e.g. a token held back until its UTF-8 character completes
                index = self.index(*key)
                stop = out.stop_reason if out.finished and not self.score_only else None
                if logprobs is None and plain:
                    yield text_chunk(index, text, finish, stop)
                    continue
                choice = CompletionChoice(
                    index=index, text=text, logprobs=logprobs, finish_reason=finish,
                    stop_reason=stop,
                )  # fmt: skip
                first.discard(key)
                plogprobs = out.prompt_logprobs if opening else None
                self._extras(choice, prompt if opening else None, token_ids, plogprobs)
                yield chunk([choice])
        if include_usage:
            yield chunk([], last=True)


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


def _top(name: Callable[[int], str], lp: TokenLogprob, num: int | None) -> dict[str, float]:
    """The legacy top_logprobs entry: the chosen token, then the `num` most likely (None:
    all the engine gave). Tokens whose text collides keep the first (most likely) one's
    logprob."""
    top = {name(lp.token_id): lp.logprob}
    for token_id, logprob in lp.top[:num]:
        top.setdefault(name(token_id), logprob)
    return top


def _extend_logprobs(
    name: Callable[[int], str],  # a token's name (Serving.token_names)
    into: CompletionLogprobs,
    tokens: Iterable[tuple[int, TokenLogprob | None]],
    offset: int = 0,
    num: int | None = None,
) -> int:
    """Append (token id, logprob) pairs in the legacy format, one without a logprob (a
    prompt's first) as nulls; returns the text offset after them."""
    for token_id, lp in tokens:
        token = name(token_id)
        into.tokens.append(token)
        into.token_logprobs.append(None if lp is None else lp.logprob)
        into.top_logprobs.append(None if lp is None else _top(name, lp, num))
        into.text_offset.append(offset)
        offset += len(token)
    return offset


def _echoed(prompt: Prompt, out: RequestOutput) -> Iterable[tuple[int, TokenLogprob | None]]:
    return zip(prompt.token_ids, out.prompt_logprobs or repeat(None))


def _sampled(out: RequestOutput) -> list[tuple[int, TokenLogprob]]:
    return [(lp.token_id, lp) for lp in out.new_logprobs or []]
