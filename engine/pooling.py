"""Embeddings (the server's /v1/embeddings): a pooling request's embedding is its
prompt's last token's final hidden state (after the model's last norm), L2-normalized
in fp32: the pooling a decoder-only embedding model is trained with (Qwen3-Embedding,
e5-mistral; vLLM's LAST pooling with normalization, its default for them). A sequence
classifier's (/classify) is its head's logits of that same state instead.

The request is an ordinary one-token request: the step that runs its prompt's last
token samples its one token, and that step also keeps the row's hidden state. Such a
step runs eagerly (the graphs keep only logits); the token is dropped by the server.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.input_batch import InputBatch
from engine.scheduler import SchedulerOutput


@dataclass
class PooledRows:
    """A step's embeddings: the pooling rows' slots, and their vectors on the host."""

    slots: list[int]
    embeddings: list[list[float]]


def pooling_rows(out: SchedulerOutput, batch: InputBatch) -> np.ndarray | None:
    """[S] bool over the step's sampling rows: those whose request pools (None: none)."""
    if not batch.num_pooling:
        return None
    rows = batch.pools[out.sampling_slots]
    return rows if rows.any() else None


def pool(
    last_hidden: torch.Tensor,
    rows: np.ndarray,
    out: SchedulerOutput,
    classifier: torch.Tensor | None = None,
) -> PooledRows:
    """last_hidden: [num_sampling, hidden] the sampling rows' final hidden states;
    classifier: a sequence classifier's head [num_labels, hidden], whose logits of the
    last token are then the rows' vectors (as transformers' *ForSequenceClassification
    scores a sequence), unnormalized."""
    picked = last_hidden[torch.from_numpy(np.flatnonzero(rows)).to(last_hidden.device)]
    if classifier is not None:
        vectors = (picked.to(classifier.dtype) @ classifier.T).float()
    else:
        vectors = torch.nn.functional.normalize(picked.float(), dim=-1)
    return PooledRows(out.sampling_slots[rows].tolist(), vectors.tolist())
