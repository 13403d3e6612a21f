"""Prompts: text and chat messages into token ids, off the event loop.

Two tokenizer lanes, each one worker thread with a tokenizer copy of its own
(one HF fast tokenizer raises "Already borrowed" when two threads encode with
it at once): prompts up to LARGE_PROMPT_CHARS go to the small lane, longer
ones to the large, so that a huge prompt never holds up everyone else's. A
prompt that has more characters than max_model_len tokens could ever hold is
rejected before any tokenizing; and work for a client that has gone away is
dropped, if it has not started yet.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request

from engine.checks import TOKEN_TYPE_SHIFT
from server.errors import APIError
from server.images import ChatPrompt, ImageProcessor, fetch_images, image_urls, web_urls
from server.protocol import ChatMessage, ChatTemplateOptions, ContentPart, ToolCall

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("pagoda.server")
T = TypeVar("T")
LARGE_PROMPT_CHARS = 32_768
# Template variables a request's chat_template_kwargs may not set: they are the call's own.
_RESERVED_TEMPLATE_KWARGS = {
    "conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
    "chat_template", "return_dict", "return_tensors", "tokenizer_kwargs", "tools", "documents",
}  # fmt: skip


def prompt_list(prompt: str | list, param: str) -> list[str | list[int]]:
    """OpenAI's four prompt shapes (a completion's prompt, an embedding's input) → a list
    of prompts, each text or token ids."""
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise APIError(f"The {param} is empty.", param=param)
    return prompts


class ClientDisconnected(Exception):
    """The client went away before its answer was ready."""


class Prompts:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        max_model_len: int,
        token_types: int = 1,
        images: ImageProcessor | None = None,  # a model that reads images: its processor
        trust_request_chat_template: bool = False,  # requests may bring their own template
    ) -> None:
        self.tokenizer = tokenizer
        self.trust_request_chat_template = trust_request_chat_template
        self.images = images
        self.max_model_len = max_model_len
        self.token_types = token_types  # > 1: an encoder whose pairs carry token types
        self._local = threading.local()  # each lane's worker: its own tokenizer copy
        self._lanes = [
            ThreadPoolExecutor(
                1,
                thread_name_prefix=f"pagoda-tokenizer-{name}",
                initializer=setattr,
                initargs=(self._local, "tokenizer", copy.deepcopy(tokenizer)),
            )
            for name in ("small", "large")
        ]
        vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        # The most characters one token can cover. A normalizer may drop characters
        # (whitespace, accents): the bound leaves a factor of 4 for that.
        self._max_chars = 4 * max(len(t or "") for t in vocab) * max_model_len
        # On the loop: one token's text (logprobs name their tokens by it), remembered.
        self.token_text: Callable[[int], str] = functools.cache(lambda t: tokenizer.decode([t]))

    @property
    def _tokenizer(self) -> PreTrainedTokenizerBase:
        return getattr(self._local, "tokenizer", self.tokenizer)

    def close(self) -> None:
        for lane in self._lanes:
            lane.shutdown(wait=False, cancel_futures=True)

    async def run(self, raw: Request | None, num_chars: int, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on a tokenizer lane; ClientDisconnected if the client leaves first
        (the work is then skipped unless it has begun)."""
        lane = self._lanes[num_chars > LARGE_PROMPT_CHARS]
        dropped = threading.Event()

        def job() -> T:
            if dropped.is_set():
                raise ClientDisconnected
            return fn(*args)

        future = asyncio.get_running_loop().run_in_executor(lane, job)
        if raw is None:
            return await future
        try:
            return await unless_disconnected(raw, future)
        except ClientDisconnected:
            dropped.set()
            future.add_done_callback(lambda f: f.cancelled() or f.exception())  # no warning
            raise

    async def fetch_images(
        self, raw: Request | None, messages: list[ChatMessage]
    ) -> dict[str, bytes]:
        """On the event loop, before the lane: the bodies of the messages' http(s) image
        URLs (for render_chat's `fetched`), all at once; nothing for a model without
        images (render_chat refuses their parts)."""
        if self.images is None:
            return {}
        urls = image_urls(messages)
        self.images.check_count(urls)  # before any is fetched
        if not web_urls(urls):
            return {}
        work = asyncio.ensure_future(fetch_images(urls, self.images.access))
        if raw is None:
            return await work
        try:
            return await unless_disconnected(raw, work)
        except ClientDisconnected:
            work.cancel()
            raise

    # ------------------------------------------------------------ on a lane

    def check_length(self, text: str, param: str) -> None:
        """Reject text that cannot fit the context however it tokenizes, cheaply."""
        if len(text) > self._max_chars:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens, and "
                f"the {param} has {len(text)} characters: more than it can hold.",
                param=param,
            )

    def encode(
        self, text: str, add_special_tokens: bool = True, max_length: int | None = None
    ) -> list[int]:
        """max_length (truncate_prompt_tokens): the text's last tokens, its special tokens
        kept (an encoder's [CLS] ... [SEP], a decoder's BOS), as vLLM's tokenizer, loaded
        with truncation_side "left", truncates a text prompt."""
        tokenizer = self._tokenizer
        if max_length is None:
            return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
        side, tokenizer.truncation_side = tokenizer.truncation_side, "left"
        try:  # on a lane's own copy, or the loop thread's: no other thread sees the side
            ids = tokenizer.encode(
                text, add_special_tokens=add_special_tokens, truncation=True, max_length=max_length
            )
        finally:
            tokenizer.truncation_side = side
        return list(ids)

    def encode_pairs(
        self, pairs: list[tuple[str, str]], add_special_tokens: bool, max_length: int | None
    ) -> list[list[int]]:
        """A cross-encoder's inputs: the tokenizer's own encoding of each text pair (its
        template's separators, or the two texts' tokens one after the other), as vLLM's;
        max_length: cut to that many tokens, the longer text first. An encoder with token
        types gets each token's packed into its id (engine/checks.py)."""
        tokenizer, cut = self._tokenizer, {}
        if max_length is not None:
            cut = dict(truncation="longest_first", max_length=max_length)
        if self.token_types > 1:
            cut["return_token_type_ids"] = True
        out = []
        for a, b in pairs:
            enc = tokenizer(a, b, add_special_tokens=add_special_tokens, **cut)
            ids = list(enc["input_ids"])
            if self.token_types > 1:
                types = enc["token_type_ids"]
                ids = [t | k << TOKEN_TYPE_SHIFT for t, k in zip(ids, types, strict=True)]
            out.append(ids)
        return out

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids)

    def render_chat(
        self,
        messages: list[ChatMessage],
        options: ChatTemplateOptions,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        fetched: dict[str, bytes] | None = None,
    ) -> ChatPrompt:
        """tools: the functions the template shows the model (server/tools.py);
        chat_template: a Jinja template instead of the tokenizer's (LLM.chat's; a trusted
        request's own takes its place); fetched: fetch_images' bodies of the messages'
        image URLs (else they are fetched here)."""
        if options.chat_template is not None:
            if not self.trust_request_chat_template:
                raise APIError(
                    "This server takes no chat_template in requests (it runs without "
                    "--trust-request-chat-template).",
                    param="chat_template",
                )
            chat_template = options.chat_template
        urls: list[str] | None = [] if self.images is not None else None
        conversation = [template_message(m, urls) for m in messages]
        tokenizer = self._tokenizer
        if not (chat_template or getattr(tokenizer, "chat_template", None)):
            raise APIError(
                "This model has no chat template; use /v1/completions.", param="messages"
            )
        if options.continue_final_message and options.add_generation_prompt:
            raise APIError(
                "continue_final_message and add_generation_prompt cannot both be true.",
                param="continue_final_message",
            )
        extra = options.chat_template_kwargs or {}
        if options.reasoning_effort is not None:
            extra = {"reasoning_effort": options.reasoning_effort, **extra}
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(extra))
        if reserved:
            raise APIError(
                f"chat_template_kwargs may not set {', '.join(reserved)}.",
                param="chat_template_kwargs",
            )
        self.check_length("".join(_text(m["content"]) for m in conversation), "messages")
        try:
            text = tokenizer.apply_chat_template(
                conversation,
                chat_template=chat_template,
                tools=tools,
                documents=options.documents,
                add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message,
                tokenize=False,
                **extra,
            )
        except Exception as exc:
            from jinja2 import TemplateError

            # The template's own raise_exception(...) speaks to the user; anything else
            # is ours, and its text stays in the log.
            why = f": {exc}" if isinstance(exc, TemplateError) else ""
            if not why:
                logger.exception("the chat template failed")
            raise APIError(
                f"The chat template rejected the messages{why}", param="messages"
            ) from exc
        if urls and self.images is not None:
            return self.images(text, urls, fetched)
        # The template already wrote any BOS it wants.
        return ChatPrompt(self.encode(text, add_special_tokens=False))


async def unless_disconnected(raw: Request, work: asyncio.Future[T]) -> T:
    """work's result; ClientDisconnected if the client leaves first (work goes on)."""

    async def disconnect() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnect())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not work.done() or work.cancelled():
        raise ClientDisconnected
    return work.result()


def template_message(message: ChatMessage, urls: list[str] | None = None) -> dict[str, Any]:
    """urls: where a model that reads images collects the message's image URLs (its
    content then stays a list of parts, an image's `{"type": "image"}`); None: text only."""
    content: str | list[dict[str, str]]
    if isinstance(message.content, list):
        content = "".join(part.text or "" for part in message.content if part.type == "text")
        kinds = {part.type for part in message.content}
        if "image_url" in kinds and urls is not None:
            content = [_template_part(part, urls) for part in message.content]
        elif kinds - {"text"}:
            what = "text and image_url" if urls is not None else "text"
            raise APIError(f"This model takes {what} content parts only.", param="messages")
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
    if message.reasoning_content is not None:
        if role != "assistant":
            raise APIError("Only assistant messages carry reasoning_content.", param="messages")
        # Qwen3's and DeepSeek's templates read reasoning_content, GPT-OSS's `thinking`.
        out["reasoning_content"] = out["thinking"] = message.reasoning_content
    return out


def _template_part(part: ContentPart, urls: list[str]) -> dict[str, str]:
    if part.type == "text":
        return {"type": "text", "text": part.text or ""}
    if part.type != "image_url":
        raise APIError("This model takes text and image_url content parts only.", param="messages")
    if part.image_url is None:
        raise APIError("An image_url content part needs its image_url.", param="messages")
    urls.append(part.image_url.url)
    return {"type": "image"}


def _text(content: str | list[dict[str, str]]) -> str:
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


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
