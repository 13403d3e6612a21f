"""Pydantic models of what the server answers, named as OpenAI (and vLLM, for extras)
name them; server/protocol.py holds the requests."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from server.protocol import ToolCall


def _omitted_if_none() -> Any:
    """A field left out of the JSON while None (vLLM's extras, sent only when asked for)."""
    return Field(default=None, exclude_if=lambda v: v is None)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The OpenAI error body every error is answered with (server/errors.py builds it)."""

    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # served by the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry: token id (as the dict key) -> this."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions logprobs object."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop token id or string that ended it
    # vLLM, on request: the prompt's ids (first chunk or response), the choice's ids
    prompt_token_ids: list[int] | None = _omitted_if_none()
    token_ids: list[int] | None = _omitted_if_none()
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = _omitted_if_none()


class CompletionResponse(BaseModel):
    """Both the whole response and each streamed chunk (OpenAI names both `text_completion`)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = _omitted_if_none()  # --reasoning-parser's, as vLLM's
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = _omitted_if_none()


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = _omitted_if_none()
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = _omitted_if_none()


class ChatStreamChoice(BaseModel):
    index: int
    # {"role": ...}, {"content": ...}, {"tool_calls": [...]}; absent keys are omitted
    delta: dict[str, Any]
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = _omitted_if_none()


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = _omitted_if_none()


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagoda"
    root: str | None = None  # a LoRA adapter's directory (vLLM's field)
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = _omitted_if_none()


class DetokenizeResponse(BaseModel):
    prompt: str
