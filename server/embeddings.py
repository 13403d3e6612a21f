"""POST /v1/embeddings: each input's embedding (engine/pooling.py: its final hidden
states pooled as the model pools, L2-normalized), in OpenAI's shape; or, as vLLM takes
it, chat messages' (the chat template's prompt, with no generation prompt unless asked).
Any served model or LoRA adapter answers; an embedding model (Qwen3-Embedding,
e5-mistral, or an encoder: bge, e5, bge-m3) is what makes the vectors worth having."""

from __future__ import annotations

import base64
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from engine.sampling_params import SamplingParams
from server.errors import APIError
from server.prompts import prompt_list
from server.protocol import ChatMessage, ChatTemplateOptions
from server.serving import Serving

if TYPE_CHECKING:
    from server.scoring import ScoringOptions

# ---------------------------------------------------------------- wire format


class EmbeddingRequest(ChatTemplateOptions):
    model: str | None = None
    input: str | list[int] | list[str] | list[list[int]] | None = None
    # vLLM's chat form, instead of input: one embedding, of the rendered conversation.
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = False
    encoding_format: Literal["float", "base64"] = "float"
    # Keep the first `dimensions` values, normalized again (Matryoshka-trained models).
    dimensions: int | None = None
    user: str | None = None  # OpenAI's hint: accepted, changes nothing
    # vLLM's extensions.
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # base64: the float32 values' little-endian bytes
    index: int


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class ListResponse(BaseModel):
    """What the pooling APIs' answers open with (embeddings, score, classify)."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class EmbeddingResponse(ListResponse):
    data: list[EmbeddingData]
    usage: EmbeddingUsage


# ---------------------------------------------------------------- serving


async def create_embedding(s: Serving, req: EmbeddingRequest, raw: Request) -> Response:
    await s.admit(req.model, task="embed")
    if req.dimensions is not None and not 1 <= req.dimensions <= (s.hidden_size or req.dimensions):
        raise APIError(
            f"dimensions must be in [1, {s.hidden_size}], got {req.dimensions}.",
            param="dimensions",
        )
    request_id = f"embd-{uuid.uuid4().hex}"
    if (req.input is None) == (req.messages is None):
        raise APIError("Give either input or messages.", param="input")
    if req.messages is not None:
        texts = [await s.render_messages(raw, req.messages, req)]
        embedded = await embed(s, raw, request_id, texts, req, "messages")
    else:
        embedded = await embed(s, raw, request_id, prompt_list(req.input, "input"), req, "input")
    data = []
    for index, vector in enumerate(embedded.vectors):
        if req.dimensions is not None:
            vector = vector[: req.dimensions]
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        value = (
            base64.b64encode(vector.astype("<f4").tobytes()).decode()
            if req.encoding_format == "base64"
            else vector.tolist()
        )
        data.append(EmbeddingData(embedding=value, index=index))
    response = EmbeddingResponse(
        id=request_id,
        model=s.answering(req.model),
        data=data,
        usage=EmbeddingUsage(prompt_tokens=embedded.num_tokens, total_tokens=embedded.num_tokens),
    )
    return Response(response.model_dump_json(), media_type="application/json")


@dataclass
class Embedded:
    vectors: np.ndarray  # [len(texts), hidden] float32, each L2-normalized
    num_tokens: int  # the prompts' tokens, in all


async def embed(
    s: Serving,
    raw: Request,
    request_id: str,
    texts: list[str | list[int]],
    req: EmbeddingRequest | ScoringOptions,  # model, truncate_prompt_tokens, add_special_tokens
    param: str,  # the field the texts came in, for errors
) -> Embedded:
    """The texts' embeddings, in order, from one engine submission."""
    truncate = s.truncation(req)
    params = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        pooling=True,
        final_only=True,
        lora_name=s.lora_name(req.model),
    )

    def prepare() -> list[list[int]]:
        return [
            s.prompt_ids(text, params, param, truncate, req.add_special_tokens) for text in texts
        ]

    text_chars = sum(len(t) for t in texts if isinstance(t, str))
    token_ids = await s.prompts.run(raw, text_chars, prepare) if text_chars else prepare()
    stream = s.async_engine.submit(request_id, token_ids, params)
    position = {rid: i for i, rid in enumerate(stream.request_ids)}
    rows: list[list[float] | None] = [None] * len(texts)
    for out in await s.collect(raw, stream):
        rows[position[out.request_id]] = out.embedding
    return Embedded(np.asarray(rows, dtype=np.float32), sum(len(ids) for ids in token_ids))
