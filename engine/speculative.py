"""Speculative decoding by n-gram lookup (vLLM's "ngram" method: prompt lookup decoding).

Each step, a running request past its prompt drafts up to K tokens: those that
followed the earliest earlier occurrence of its last n tokens, in its prompt or
output, for the longest n in [prompt_lookup_min, prompt_lookup_max] that occurs.
The step then computes the request's last sampled token and its d drafts in one
forward, as a chunk of 1 + d tokens (the scheduler adds the drafts to its new
tokens, and StepInputs asks for a logits row at each of them), and the sampler
checks the drafts in order (Sampler.verify). The accepted drafts, then the token
sampled where the first draft was refused (or after the last), are the step's
tokens: 1 to d + 1 of them, each distributed as without speculation, and
token for token the same under greedy decoding. The KV written for refused
drafts lies past the request's computed tokens, where later steps rewrite it.

A draft continues the last sampled id, so speculation reads every step's ids
before planning the next (EngineConfig turns asynchronous scheduling off).
Every draft's row is processed as a step at its position would be (logit_bias and
allowed_token_ids; penalties, min_tokens and bad words counting the drafts before it:
Sampler.verify), and each token's logprobs come from its own row
(NgramSpeculator.read). Requests with a seed (which promises the tokens of a run
without drafts) or a grammar do not draft (SamplingParams.speculates): they sample
one token a step beside those that do. A step with grammar rows, prompt scoring or
embeddings drafts nothing (nor one that admits such a request: engine/scheduler.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.config import EngineConfig
from engine.input_batch import InputBatch
from engine.sampler import Sampler
from engine.scheduler import SchedulerOutput
from engine.step_reader import LaunchedStep, StepReader


def ngram_draft(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to k tokens that followed the earliest earlier occurrence of the last n tokens
    of `tokens` [L], for the longest n in [min_n, max_n] that has one (empty if none)."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # Occurrences that some token follows: the suffix itself is not one.
        starts = np.flatnonzero(tokens[: length - n] == suffix[0])
        for j in range(1, n):
            if not len(starts):
                break
            starts = starts[tokens[starts + j] == suffix[j]]
        if len(starts):
            begin = starts[0] + n
            return tokens[begin : begin + k]
    return tokens[:0]


@dataclass
class Verified:
    """A step's verdict on its drafts, per sampling sequence (in batch order)."""

    num_accepted: np.ndarray  # [B] drafts accepted
    # [B, 1 + most drafts] the sequence's tokens this step: the accepted drafts, then
    # the token sampled after them (entries past that one: -1).
    token_ids: np.ndarray
    first_rows: np.ndarray  # [B] each sequence's first logits row


class NgramSpeculator:
    def __init__(self, config: EngineConfig, batch: InputBatch, sampler: Sampler) -> None:
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.batch, self.sampler = batch, sampler
        self.num_draft_tokens = 0  # cumulative, as vLLM's spec_decode counters
        self.num_accepted_tokens = 0

    def propose(self) -> None:
        """Draft the next tokens of the running requests that may: into the batch's
        token table past each one's num_tokens, their counts into num_drafts."""
        batch = self.batch
        batch.num_draft_tokens = 0
        if not batch.num_speculating or batch.num_grammar or batch.num_scoring or batch.num_pooling:
            return
        slots = batch.slots
        num_tokens = batch.num_tokens[slots]
        # Past its prompt, with every id on the host; the drafts and the token sampled
        # after them must fit under its length limit.
        room = batch.max_num_tokens[slots] - num_tokens - 1
        ready = batch.speculates[slots] & (batch.num_computed[slots] == num_tokens - 1) & (room > 0)
        batch.num_drafts[slots] = 0
        total = 0
        for slot, n, limit in zip(
            slots[ready].tolist(), num_tokens[ready].tolist(), room[ready].tolist()
        ):
            row = batch.token_ids[slot]
            draft = self.draft(slot, row[:n], min(self.k, limit))
            d = len(draft)
            if d:
                row[n : n + d] = draft
                batch.num_drafts[slot] = d
                total += d
        batch.num_draft_tokens = total

    def draft(self, slot: int, tokens: np.ndarray, k: int) -> np.ndarray:
        """Up to k draft tokens to follow a row's tokens [num_tokens]."""
        return ngram_draft(tokens, self.min_n, self.max_n, k)

    def verify(
        self, logits: torch.Tensor, out: SchedulerOutput, argmax: torch.Tensor | None
    ) -> Verified:
        """Check a step's drafts against its logits ([out.num_logits, vocab]: per sampling
        sequence, a row for each draft, then its last)."""
        batch = self.batch
        sampling = out.sampling_slots
        drafts = out.num_drafts[out.samples]  # [B]
        rows = drafts + 1
        first = np.cumsum(rows) - rows
        num_rows = out.num_logits
        row_slots = np.repeat(sampling, rows)
        offset = np.arange(num_rows) - np.repeat(first, rows)  # [R] row within its sequence
        # Row i of a sequence checks its draft i, which sits at num_tokens + i.
        at = batch.row_start[row_slots] + np.repeat(batch.num_tokens[sampling], rows) + offset
        row_drafts = np.where(offset < np.repeat(drafts, rows), batch.token_flat[at], -1)
        ids, accepted = self.sampler.verify(logits, row_slots, row_drafts, offset, argmax)
        # One copy to the host; the rest is a few small arrays.
        if accepted is None:  # all greedy: a draft stands if it is the argmax
            ids_np = ids.cpu().numpy()
            accepted_np = ids_np == row_drafts
        else:
            both = torch.stack([ids, accepted.long()]).cpu().numpy()
            ids_np, accepted_np = both[0], both[1].astype(bool)
        width = int(drafts.max())
        # [B, 1 + width]: row j of each sequence, its last row past its drafts (it
        # checks none, so a count of accepted drafts stops there).
        grid = first[:, None] + np.minimum(np.arange(width + 1), drafts[:, None])
        num_accepted = np.cumprod(accepted_np[grid[:, :width]], axis=1).sum(1)  # [B]
        final = ids_np[grid[np.arange(len(sampling)), num_accepted]]
        token_ids = np.where(np.arange(width + 1) < num_accepted[:, None], row_drafts[grid], -1)
        token_ids[np.arange(len(sampling)), num_accepted] = final
        self.num_draft_tokens += int(drafts.sum())
        self.num_accepted_tokens += int(num_accepted.sum())
        return Verified(num_accepted, token_ids, first)

    def read(
        self, out: SchedulerOutput, verified: Verified, logits: torch.Tensor, reader: StepReader
    ) -> int:
        """Read a verified step's 1 to d + 1 tokens per sampling row as that many one-token
        steps: the reads find stops, length limits and news as they do for any step, and a
        request they finish reads no more. Returns the rows read."""
        batch = self.batch
        sampling = out.sampling_slots
        accepted, token_ids = verified.num_accepted, verified.token_ids
        batch.refuse(sampling, out.num_drafts[out.samples] - accepted)
        generations = batch.generation[sampling]
        num_read = 0
        for j in range(token_ids.shape[1]):
            slots, ids, rows = sampling, token_ids[:, j], verified.first_rows + j
            if j:  # rows with a j-th token, whose request no read has finished
                keep = (accepted >= j) & (batch.generation[sampling] == generations)
                if not keep.any():
                    break
                slots, ids, rows = slots[keep], ids[keep], rows[keep]
            logprobs = None  # a token's logprobs come from its own position's logits row
            if batch.num_needs_sync and batch.needs_sync[slots].any():
                at = torch.from_numpy(rows).to(logits.device)
                chosen = torch.from_numpy(ids).to(logits.device)
                logprobs = self.sampler.read(logits[at], chosen, slots).logprobs
            mark = batch.launched(slots)
            num_read += len(slots)
            reader.read(LaunchedStep(slots, mark, ids, logprobs))
        return num_read
