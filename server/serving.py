"""What completions and chat share: model checks, prompt preparation off the loop,
sampling params, and the two ways of answering (one JSON body, or SSE)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from engine.request import RequestOutput, TokenLogprob, out_of_vocab
from engine.sampling_params import SamplingParams
from engine.structured.spec import GrammarSpec
from server.async_engine import AsyncEngine, RequestStream
from server.errors import APIError, error_body, from_value_error
from server.protocol import (
    ChatMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    SamplingRequest,
    TokenizeRequest,
    TokenizeResponse,
    ToolCall,
    UsageInfo,
)

logger = logging.getLogger("pagoda.server")
T = TypeVar("T")


@dataclass
class ChoiceState:
    """One choice's text, logprobs and ending, accumulated from its deltas."""

    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.num_prompt_tokens = out.num_prompt_tokens
        self.logprobs.extend(out.new_logprobs or [])
        self.num_output_tokens = out.num_output_tokens
        if out.finished:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason


class Usage:
    """Counts prompt tokens once per prompt and completion tokens once per choice."""

    def __init__(self) -> None:
        self._prompt: dict[str, int] = {}
        self._completion: dict[tuple[str, int], int] = {}

    def record(self, request_id: str, index: int, num_prompt: int, num_output: int) -> None:
        self._prompt[request_id] = num_prompt
        self._completion[(request_id, index)] = num_output

    def add(self, out: RequestOutput) -> None:
        self.record(out.request_id, out.index, out.num_prompt_tokens, out.num_output_tokens)

    def info(self) -> UsageInfo:
        prompt, completion = sum(self._prompt.values()), sum(self._completion.values())
        return UsageInfo(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )


class Serving:
    """Holds the engine bridge and the tokenizer; shared by the route handlers."""

    def __init__(
        self,
        async_engine: AsyncEngine,
        served_model_name: str | None,
        tool_call_parser: str | None = None,
    ) -> None:
        engine = async_engine.engine
        # Finds calls in the output for tool_choice "auto" (None: auto is refused).
        self.tool_call_parser = tool_call_parser
        self.async_engine = async_engine
        self.tokenizer = engine.tokenizer
        self.model_name = served_model_name or engine.model_name
        self.max_model_len: int = engine.config.max_model_len
        self.vocab_size: int = engine.vocab_size
        self._check_request = engine.check_request
        # One worker: HF fast tokenizers may raise "Already borrowed" when one
        # instance encodes on several threads at once.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="pagoda-tokenizer")
        self._token_text: dict[int, str] = {}

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Tokenizer work, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                f"The model `{model}` does not exist.", 404, param="model", code="model_not_found"
            )

    # ------------------------------------------------------------ prompts (executor)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        tools: list[dict] | None = None,
    ) -> list[int]:
        conversation = [_template_message(m) for m in messages]
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(
                "This model has no chat template; use /v1/completions.", param="messages"
            )
        try:
            text = self.tokenizer.apply_chat_template(
                conversation,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except Exception as exc:  # jinja's raise_exception(...) and friends: the input's fault
            raise APIError(
                f"The chat template rejected the messages: {exc}", param="messages"
            ) from exc
        # The template already wrote any BOS it wants.
        return self.encode(text, add_special_tokens=False)

    def check_prompt(self, ids: list[int], params: SamplingParams, param: str) -> None:
        """The engine's own limits, as 400s that name the numbers."""
        limit = self.max_model_len
        if not ids:
            raise APIError("The prompt is empty.", param=param)
        bad = out_of_vocab(ids, self.vocab_size)
        if bad is not None:
            raise APIError(
                f"Token id {bad} is out of vocabulary (vocabulary size {self.vocab_size}).",
                param=param,
            )
        if len(ids) >= limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens, but the prompt has "
                f"{len(ids)} tokens, leaving no room for the completion.",
                param=param,
            )
        if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, "
                f"{params.max_tokens} for the completion). Reduce the prompt or max_tokens.",
                param="max_tokens",
            )
        try:
            self._check_request(ids, params)
        except ValueError as exc:
            raise from_value_error(exc) from exc

    def sampling_params(
        self,
        req: SamplingRequest,
        max_tokens: int | None,
        logprobs: int | None,
        grammar: GrammarSpec | None = None,
    ) -> SamplingParams:
        """OpenAI fields → SamplingParams; its ValueErrors become 400s naming the field."""
        if req.stream_options is not None and not req.stream:
            raise APIError(
                "stream_options is only allowed when stream is true.", param="stream_options"
            )
        if req.seed is not None and not -(2**63) <= req.seed < 2**63:
            # The sampler seeds a torch.Generator, which takes 64 bits; past that the
            # engine step itself would fail.
            raise APIError(f"seed must fit in 64 bits, got {req.seed}.", param="seed")
        try:
            logit_bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
        except ValueError as exc:
            raise APIError("logit_bias keys must be token ids.", param="logit_bias") from exc
        values = {
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "min_p": req.min_p,
            "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty,
            "repetition_penalty": req.repetition_penalty,
        }
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                n=req.n,
                seed=req.seed,
                stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
                stop_token_ids=list(req.stop_token_ids or []),
                logit_bias=logit_bias or None,
                logprobs=logprobs,
                ignore_eos=req.ignore_eos,
                min_tokens=req.min_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
                grammar=grammar,
                **{k: v for k, v in values.items() if v is not None},  # null = OpenAI's default
            )
            params.check_vocab(self.vocab_size)
        except ValueError as exc:
            raise from_value_error(exc) from exc
        return params

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    # ------------------------------------------------------------ answering

    async def collect(
        self, raw: Request, stream: RequestStream
    ) -> dict[tuple[str, int], ChoiceState]:
        """Every choice's full result; aborts the request if the client disconnects first."""

        async def consume() -> dict[tuple[str, int], ChoiceState]:
            choices: dict[tuple[str, int], ChoiceState] = {}
            async for outputs in stream:
                for out in outputs:
                    choices.setdefault((out.request_id, out.index), ChoiceState()).add(out)
            return choices

        async def disconnected() -> None:
            while (await raw.receive())["type"] != "http.disconnect":
                pass

        work, watch = asyncio.ensure_future(consume()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
                stream.abort()
        if not work.done() or work.cancelled():
            raise ClientDisconnected
        return work.result()

    def sse(self, stream: RequestStream, payloads: AsyncIterator[str]) -> StreamingResponse:
        return _SSEResponse(stream, _sse_events(stream, payloads))

    # ------------------------------------------------------------ small endpoints

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, max_model_len=self.max_model_len)])

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("Give either prompt or messages.", param="prompt")
        if req.messages is not None:
            ids = await self.run(self.render_chat, req.messages, req.add_generation_prompt)
        else:
            ids = await self.run(self.encode, req.prompt, req.add_special_tokens)
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=self.max_model_len)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(req.model)
        bad = next((t for t in req.tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(f"Token id {bad} is out of vocabulary.", param="tokens")
        return DetokenizeResponse(prompt=await self.run(self.tokenizer.decode, req.tokens))


class ClientDisconnected(Exception):
    """The client went away before a non-streamed answer was ready."""


def _template_message(message: ChatMessage) -> dict[str, Any]:
    if isinstance(message.content, list):
        if any(part.type != "text" for part in message.content):
            raise APIError("Only text content parts are supported.", param="messages")
        content = "".join(part.text or "" for part in message.content)
    else:
        content = message.content or ""
    role = "system" if message.role == "developer" else message.role  # templates know "system"
    out: dict[str, Any] = {"role": role, "content": content}
    if message.name:
        out["name"] = message.name
    if message.tool_calls:
        if role != "assistant":
            raise APIError("Only assistant messages carry tool_calls.", param="messages")
        out["tool_calls"] = [_template_call(call) for call in message.tool_calls]
    if role == "tool":
        if message.tool_call_id is None:
            raise APIError("A tool message needs tool_call_id.", param="messages")
        out["tool_call_id"] = message.tool_call_id
    elif message.tool_call_id is not None:
        raise APIError("Only tool messages carry tool_call_id.", param="messages")
    return out


def _template_call(call: ToolCall) -> dict[str, Any]:
    """As chat templates expect a call: the arguments as an object, not JSON text."""
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError as exc:
        raise APIError(
            f"The arguments of tool call {call.id!r} are not valid JSON: {exc}", param="messages"
        ) from exc
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }


async def _sse_events(stream: RequestStream, payloads: AsyncIterator[str]) -> AsyncIterator[str]:
    """`data: {json}` events, an error event if generation fails midway, `[DONE]` last."""
    try:
        async for payload in payloads:
            yield f"data: {payload}\n\n"
    except APIError as exc:
        yield f"data: {json.dumps(exc.body())}\n\n"
    except Exception as exc:
        logger.exception("stream failed")
        yield f"data: {json.dumps(error_body(f'Internal error: {exc}', 500))}\n\n"
    finally:
        stream.abort()  # a no-op when finished; frees the engine's blocks when cancelled
    yield "data: [DONE]\n\n"


class _SSEResponse(StreamingResponse):
    """Aborts the request however the response ends, even if streaming never began."""

    def __init__(self, stream: RequestStream, content: AsyncIterator[str]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._stream = stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.abort()


def disconnected_response() -> Response:
    return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
