"""Pydantic models of the requests, named as OpenAI (and vLLM, for extras) name them;
server/replies.py holds what the server answers."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from server.errors import APIError

# vLLM's and OpenAI's request fields Pagoda does not implement: a 400 that says so (any
# other unknown field is a 400 too, as an unrecognized one).
UNSUPPORTED_FIELDS = (
    "early_stopping", "guided_decoding_backend", "guided_whitespace_pattern",
    "logits_processors", "kv_transfer_params", "vllm_xargs", "mm_processor_kwargs",
    "spaces_between_special_tokens", "functions", "function_call", "prediction", "audio",
    "modalities", "prompt_embeds", "lora_request",
)  # fmt: skip


def _check_text(value: Any, field: str) -> None:
    """A lone surrogate (JSON allows "\\ud800") cannot be tokenized or encoded: 400."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(
                f"{field} contains a lone surrogate, which is not valid Unicode text.", param=field
            ) from None
    elif isinstance(value, list):
        if value and isinstance(value[0], int):
            return  # token ids (a mixed list fails validation anyway)
        for item in value:
            _check_text(item, field)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, field)
            _check_text(item, field)


def _null_where_screened(schema: dict[str, Any]) -> None:
    """The request schema says what _screen accepts: null for every optional field (the
    default) and for any property not declared (ignored)."""
    schema["additionalProperties"] = {"type": "null"}
    required = set(schema.get("required", ()))
    properties = schema.get("properties", {})
    for name, prop in properties.items():
        kinds = [prop, *prop.get("anyOf", ())]
        if name in required or any(kind.get("type") == "null" for kind in kinds):
            continue
        outer = {key: prop.pop(key) for key in ("title", "description", "default") if key in prop}
        properties[name] = {"anyOf": [prop, {"type": "null"}], **outer}


class _Request(BaseModel):
    # Types are strict ("10" is no int, true no number: 400, never coerced). A field
    # Pagoda does not implement is a 400 naming it, never silently ignored (OpenAI
    # answers an unrecognized argument so too): the hints OpenAI documents are
    # declared, and change nothing. null is the default of an optional field (the
    # OpenAI SDK sends it) and an unknown field sent as null asks for nothing: both
    # are dropped (_screen), and the schema says so.
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        populate_by_name=True,
        json_schema_extra=_null_where_screened,
    )

    @model_validator(mode="before")
    @classmethod
    def _screen(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name in UNSUPPORTED_FIELDS:  # unless the model has it (rerank's documents)
            if name not in cls.model_fields and data.get(name) not in (None, False):
                raise APIError(f"{name} is not supported by this server.", param=name)
        for name, value in data.items():
            _check_text(value, name)
        # null where OpenAI allows it means the default (an optional field only); an
        # unimplemented one off or null asks for nothing.
        fields = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if (v is not None or (k in fields and fields[k].is_required()))
            and not (v is False and k in UNSUPPORTED_FIELDS)
        }


# The base of every request model (server/responses_protocol.py's too).
RequestModel = _Request


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class JsonSchemaFormat(_Request):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs`: one of these constraints."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingRequest(_Request):
    """Fields completions and chat share: OpenAI's, then vLLM's extensions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Hints OpenAI documents (identifying the end user, storing, routing): accepted,
    # and they change nothing here.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Structured outputs (exactly one constraint per request): OpenAI's, vLLM's
    # object, and vLLM's legacy aliases.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM: only these ids may be generated
    bad_words: list[str] | None = None  # vLLM: words never generated
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # vLLM: keep the prompt's last k tokens
    return_token_ids: bool = False  # vLLM: prompt_token_ids and each choice's token_ids
    return_tokens_as_token_ids: bool = False  # vLLM: logprobs name tokens "token_id:{id}"
    cache_salt: str | None = None  # vLLM: cached prefixes shared within one salt only
    priority: int = 0  # vLLM: lower first, under --scheduling-policy priority
    use_beam_search: bool = False  # vLLM: the n best beams (server/beam_search.py)
    length_penalty: float = 1.0  # beam search: scores are logprob / length ** this
    prompt_logprobs: int | None = None  # vLLM: the prompt's logprobs, k alternatives each


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True  # vLLM: the tokenizer's BOS and friends


class ImageURL(_Request):
    url: str  # a data URL (base64) or an http(s) URL
    detail: Literal["auto", "low", "high"] | None = None  # OpenAI's hint: changes nothing


class ContentPart(_Request):
    type: str  # "text", or "image_url" for a model that reads images
    text: str | None = None
    image_url: ImageURL | None = None


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's answer: to which call
    # An assistant's reasoning, as --reasoning-parser returned it (clients send answers
    # back whole in the history)
    reasoning_content: str | None = None


class ChatTemplateOptions(_Request):
    """How messages become a prompt (vLLM's chat request and /tokenize fields)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is left open
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables
    # vLLM's: documents for a RAG template (each e.g. {"title": ..., "text": ...})
    documents: list[dict[str, str]] | None = None
    # OpenAI's field, the template variable `reasoning_effort` (GPT-OSS's template reads it)
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    # vLLM's: a Jinja template for this request instead of the server's (a 400 unless the
    # server runs with --trust-request-chat-template)
    chat_template: str | None = None


class FunctionDefinition(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest, ChatTemplateOptions):
    messages: list[ChatMessage] = Field(min_length=1)  # OpenAI: [] is a 400
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    echo: bool = False  # vLLM: the last message's content opens the answer


class TokenizeRequest(ChatTemplateOptions):
    """vLLM's /tokenize: either a prompt or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]
