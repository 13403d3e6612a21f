"""Prompt logprobs (vLLM's prompt_logprobs): each prompt token's logprob given the
tokens before it, taken from the hidden states of the prefill that runs anyway.

Position p's logits score prompt token p + 1, so a prefill chunk covering
positions [start, end) of a request that asks scores prompt tokens start + 1 ..
min(end, num_prompt - 1); the prompt's last position is left to the sampler (it
samples the first output token, as for every request). A request's first prompt
token has no entry. Such a request takes no prefix-cache hits (every position's
logits are needed), and a step that scores runs eagerly: the prefill graphs
keep only the sampling rows' logits.

Logits are computed SCORE_ROWS rows at a time, so that a long prompt never holds
a [prompt_len, vocab] fp32 tensor; log_softmax is in fp32, like the sampler's
logprobs, and each row's logprob, rank and top-k go to the host in one copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.input_batch import InputBatch
from engine.request import TokenLogprob
from engine.sampler import logprob_rows, token_logprob
from engine.scheduler import SchedulerOutput

SCORE_ROWS = 512  # hidden-state rows turned into logits at once


@dataclass
class PromptScoring:
    """Which of a step's token rows score which prompt tokens, per scoring sequence; once
    score_prompts has run, the step's prompt logprobs on the host too."""

    slots: list[int]  # the scoring sequences' InputBatch rows
    firsts: list[int]  # the first prompt token each scores (its chunk's start + 1)
    counts: list[int]  # how many prompt tokens each scores
    num_top: list[int]  # the top alternatives each asks for (its prompt_logprobs)
    rows: np.ndarray  # [R] int64: the step's token rows (hidden states) that score
    token_ids: np.ndarray  # [R] int64: the prompt token each of them scores
    entries: list[list[TokenLogprob]] | None = None  # each sequence's run, by score_prompts


def plan_scoring(out: SchedulerOutput, batch: InputBatch) -> PromptScoring | None:
    """The step's scoring rows, or None when no scheduled sequence scores its prompt."""
    scoring = batch.scores_prompt[out.slots]
    if not scoring.any():
        return None
    query_starts = np.cumsum(out.num_new_tokens) - out.num_new_tokens  # [num_seqs]
    slots, firsts, counts, num_top, rows, token_ids = [], [], [], [], [], []
    for b in np.flatnonzero(scoring).tolist():
        slot, start = int(out.slots[b]), int(out.starts[b])
        end = min(start + int(out.num_new_tokens[b]), int(batch.num_prompt[slot]) - 1)
        if end <= start:  # a chunk of the prompt's last token only
            continue
        slots.append(slot)
        firsts.append(start + 1)
        counts.append(end - start)
        num_top.append(batch.requests[slot].params.prompt_logprobs)
        rows.append(np.arange(end - start, dtype=np.int64) + query_starts[b])
        token_ids.append(batch.token_ids[slot, start + 1 : end + 1].astype(np.int64))
    if not slots:
        return None
    return PromptScoring(
        slots, firsts, counts, num_top, np.concatenate(rows), np.concatenate(token_ids)
    )


def score_prompts(
    hidden: torch.Tensor,  # [num_tokens, hidden_size]: the step's final hidden states
    scoring: PromptScoring,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> PromptScoring:
    """Logprob, rank and top-k of each scored prompt token, read back to the host into
    scoring.entries; returns scoring."""
    device = hidden.device
    rows = torch.from_numpy(scoring.rows).to(device)
    targets = torch.from_numpy(scoring.token_ids).to(device)
    k = max(scoring.num_top)
    num_rows = len(scoring.rows)
    packed = torch.empty(num_rows, 2 + 2 * k, dtype=torch.float64, device=device)
    for i in range(0, num_rows, SCORE_ROWS):
        j = min(i + SCORE_ROWS, num_rows)
        logprobs = compute_logits(hidden[rows[i:j]]).float().log_softmax(-1)  # [j - i, vocab]
        packed[i:j] = logprob_rows(logprobs, targets[i:j], k)
    values = packed.tolist()
    token_ids = scoring.token_ids.tolist()
    scoring.entries = []
    row = 0
    for count, num_top in zip(scoring.counts, scoring.num_top, strict=True):
        run = range(row, row + count)
        scoring.entries.append([token_logprob(token_ids[r], values[r], k, num_top) for r in run])
        row += count
    return scoring
