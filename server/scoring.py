"""vLLM's score and rerank APIs: a pair's score is the cosine similarity of the two
texts' embeddings (server/embeddings.py), as vLLM scores with an embedding model; with a
one-label sequence classifier (a cross-encoder, server/classify.py), the sigmoid of its
logit over the pair, encoded as the tokenizer encodes a text pair. `/v1/score` scores
text_1 against each text_2 (or pairwise, two lists of one length); `/v1/rerank` (also
`/rerank`, `/v2/rerank`: Jina's and Cohere's shape) orders documents by their score
against the query."""

from __future__ import annotations

import uuid
from typing import Literal

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from engine.classification import class_probabilities
from server.embeddings import EmbeddingUsage, ListResponse, embed
from server.errors import APIError
from server.protocol import RequestModel
from server.serving import Serving

# ---------------------------------------------------------------- wire format


class ScoringOptions(RequestModel):
    """What score and rerank requests share with an embedding request."""

    model: str | None = None
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    user: str | None = None  # accepted, changes nothing


class ScoreRequest(ScoringOptions):
    text_1: str | list[str]
    text_2: str | list[str]


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(ListResponse):
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankRequest(ScoringOptions):
    query: str
    documents: list[str]
    top_n: int | None = None  # None or 0: all of them
    return_documents: bool = True


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


# ---------------------------------------------------------------- serving


def _texts(value: str | list[str], param: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not texts or any(not t for t in texts):
        raise APIError(f"{param} must hold non-empty text.", param=param)
    return texts


async def pair_scores(
    s: Serving,
    raw: Request,
    request_id: str,
    pairs: list[tuple[str, str]],
    req: ScoringOptions,
    param: str,  # the field the pairs' texts came in, for errors
) -> tuple[np.ndarray, int]:
    """A cross-encoder's scores of the pairs, and the tokens they took."""
    for pair in pairs:
        for text in pair:
            s.prompts.check_length(text, param)
    chars = sum(len(a) + len(b) for a, b in pairs)
    encode, special = s.prompts.encode_pairs, req.add_special_tokens
    ids = await s.prompts.run(raw, chars, encode, pairs, special, s.truncation(req))
    logits = await embed(s, raw, request_id, ids, req, param)
    return class_probabilities(logits.vectors)[:, 0], logits.num_tokens


async def create_score(s: Serving, req: ScoreRequest, raw: Request) -> Response:
    await s.admit(req.model, task="score")
    first, second = _texts(req.text_1, "text_1"), _texts(req.text_2, "text_2")
    if len(first) != 1 and len(first) != len(second):
        raise APIError(
            f"text_1 holds {len(first)} texts and text_2 {len(second)}: give one text_1, "
            "or as many as text_2.",
            param="text_1",
        )
    request_id = f"score-{uuid.uuid4().hex}"
    if s.labels:  # a cross-encoder
        pairs = [(first[i if len(first) > 1 else 0], b) for i, b in enumerate(second)]
        scores, num_tokens = await pair_scores(s, raw, request_id, pairs, req, "text_1")
    else:
        embedded = await embed(s, raw, request_id, [*first, *second], req, "text_1")
        left, right = embedded.vectors[: len(first)], embedded.vectors[len(first) :]
        scores = (left * right).sum(axis=1)  # unit vectors: their cosine similarity
        num_tokens = embedded.num_tokens
    response = ScoreResponse(
        id=request_id,
        model=s.answering(req.model),
        data=[ScoreData(index=i, score=float(v)) for i, v in enumerate(scores)],
        usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
    )
    return Response(response.model_dump_json(), media_type="application/json")


async def create_rerank(s: Serving, req: RerankRequest, raw: Request) -> Response:
    await s.admit(req.model, task="score")
    query, documents = _texts(req.query, "query")[0], _texts(req.documents, "documents")
    if req.top_n is not None and req.top_n < 0:
        raise APIError(f"top_n must be non-negative, got {req.top_n}.", param="top_n")
    request_id = f"rerank-{uuid.uuid4().hex}"
    if s.labels:  # a cross-encoder
        pairs = [(query, document) for document in documents]
        scores, num_tokens = await pair_scores(s, raw, request_id, pairs, req, "documents")
    else:
        embedded = await embed(s, raw, request_id, [query, *documents], req, "documents")
        scores = embedded.vectors[1:] @ embedded.vectors[0]
        num_tokens = embedded.num_tokens
    order = np.argsort(-scores, kind="stable")[: req.top_n or None]
    results = [
        RerankResult(
            index=int(i),
            document=RerankDocument(text=documents[i]) if req.return_documents else None,
            relevance_score=float(scores[i]),
        )
        for i in order
    ]
    response = RerankResponse(
        id=request_id,
        model=s.answering(req.model),
        usage=RerankUsage(total_tokens=num_tokens),
        results=results,
    )
    return Response(response.model_dump_json(), media_type="application/json")
