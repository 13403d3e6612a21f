"""Pydantic models of OpenAI's Responses API (POST /v1/responses), the subset Pagoda
serves: text (and image) message input, function tools and their results, reasoning, JSON
output formats. Requests are as strict as the chat ones (server/protocol.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from server.protocol import RequestModel


class InputContentPart(RequestModel):
    """A message's text part; an assistant message sent back carries output_text parts
    with their annotations and logprobs, which are accepted and left out."""

    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputImagePart(RequestModel):
    """An image, for a model that reads images: a data URL or an http(s) URL."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None  # the Files API's: not served
    detail: Literal["auto", "low", "high"] | None = None  # a hint: changes nothing


class ReasoningPart(RequestModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class InputItem(RequestModel):
    """One item of `input`: a message (`type` may be left out), a function call the
    model made, its output, or the model's reasoning, as a previous response gave them."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    id: str | None = None
    status: str | None = None
    # message
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[InputContentPart | InputImagePart] | list[ReasoningPart] | None = None
    # function_call, function_call_output
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None
    # reasoning
    summary: list[ReasoningPart] | None = None
    encrypted_content: str | None = None


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedTool(RequestModel):
    type: Literal["function"]
    name: str


class ReasoningOptions(RequestModel):
    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # accepted; none is written


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(RequestModel):
    format: TextFormat | None = None


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool = True
    reasoning: ReasoningOptions | None = None
    text: TextOptions | None = None
    # Responses are not stored: a previous one cannot be continued (a 400 says so).
    previous_response_id: str | None = None
    # Hints OpenAI documents: accepted, and they change nothing here.
    store: bool | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    truncation: Literal["disabled"] | None = None
    # Extra output asked for (encrypted reasoning, logprobs, ...): none is written, as a
    # server without stored or encrypted state can give none.
    include: list[str] | None = None


# ---------------------------------------------------------------- the response


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class MessageItem(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class ReasoningItem(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    call_id: str
    name: str
    arguments: str


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # not counted apart from the answer's


class ResponseUsage(BaseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete"]
    output: list[ReasoningItem | MessageItem | FunctionCallItem]
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | NamedTool = "auto"
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    reasoning: ReasoningOptions | None = None
    text: TextOptions | None = None
    truncation: Literal["disabled"] = "disabled"
    metadata: dict[str, str] = Field(default_factory=dict)
    usage: ResponseUsage | None = None
