"""POST /classify (vLLM's classification API): each input's class probabilities from a
sequence classifier (a *ForSequenceClassification checkpoint: Qwen2, Qwen3, Llama,
Mistral, ... with a `score` head, or a BERT or XLM-RoBERTa encoder's). The logits are the
head's over the last token's final hidden state (an encoder's: the first token's;
engine/pooling.py), as transformers scores a sequence; the probabilities
their softmax, or with one label their sigmoid (a reward or relevance score), as vLLM's.
"""

from __future__ import annotations

import uuid

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from engine.classification import class_probabilities
from server.embeddings import EmbeddingUsage, ListResponse, embed
from server.prompts import prompt_list
from server.scoring import ScoringOptions
from server.serving import Serving

# ---------------------------------------------------------------- wire format


class ClassificationRequest(ScoringOptions):
    input: str | list[int] | list[str] | list[list[int]]


class ClassificationData(BaseModel):
    index: int
    label: str  # the likeliest class's name (config.json's id2label)
    probs: list[float]
    num_classes: int


class ClassificationResponse(ListResponse):
    data: list[ClassificationData]
    usage: EmbeddingUsage


# ---------------------------------------------------------------- serving


async def create_classification(s: Serving, req: ClassificationRequest, raw: Request) -> Response:
    await s.admit(req.model, task="classify")
    request_id = f"classify-{uuid.uuid4().hex}"
    logits = await embed(s, raw, request_id, prompt_list(req.input, "input"), req, "input")
    data = [
        ClassificationData(
            index=index,
            label=s.labels[int(np.argmax(probs))],
            probs=probs.tolist(),
            num_classes=len(probs),
        )
        for index, probs in enumerate(class_probabilities(logits.vectors))
    ]
    response = ClassificationResponse(
        id=request_id,
        model=s.answering(req.model),
        data=data,
        usage=EmbeddingUsage(prompt_tokens=logits.num_tokens, total_tokens=logits.num_tokens),
    )
    return Response(response.model_dump_json(), media_type="application/json")
