"""Sampler: one batched pass from logits to next tokens (and their logprobs).

Order of processing, per row, as vLLM does it:
    grammar bitmask (structured outputs) → allowed_token_ids → bad_words → logit_bias
    → repetition/frequency/presence penalties → min_tokens mask
    → greedy rows take the argmax here
    → temperature → top_k → top_p → min_p → exponential race.
Logprobs are the raw log_softmax of the model's logits (vLLM's default
"raw_logprobs"), untouched by any of the above.

The all-greedy, nothing-to-apply batch is exactly `logits.argmax(-1)`, which
the CUDA decode graph has taken already (`argmax`): its result stays on the
device for the next step. Rows are the InputBatch's slots: what every row
asks every step (is it argmax-only, its temperature and top-k/p) is read from
the batch's columns; the rest (penalties, biases, token bans, seeds, logprobs) from
the few requests that ask for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.bad_words import banned_ids
from engine.input_batch import InputBatch
from engine.request import Request, TokenLogprob
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.structured.masks import BatchBitmask


# The row of a request that a read just before sampling finished (engine.step): it is
# sampled as plain greedy, and its id is dropped when read.
_VOID = Request("void", [0], SamplingParams(temperature=0.0))


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per request
    logprobs: list[TokenLogprob | None]  # per request; None where params.logprobs is None


class Sampler:
    def __init__(
        self,
        vocab_size: int,
        device: torch.device,
        seed: int,
        eos_token_ids: list[int],
        batch: InputBatch,
    ) -> None:
        # Token ids and ranks travel back packed in a float64 tensor (one copy).
        assert vocab_size < 2**53
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.eos_token_ids = list(eos_token_ids)
        self.batch = batch
        # Shared by every unseeded row; seeded rows own a generator each.
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def read(
        self, logits: torch.Tensor, token_ids: torch.Tensor, slots: np.ndarray
    ) -> SamplerOutput:
        """The sampled ids on the host, with the logprobs the requests asked for."""
        requests = self._requests(slots)
        rows = [i for i, req in enumerate(requests) if req.params.logprobs is not None]
        if not rows:
            return SamplerOutput(token_ids.tolist(), [None] * len(requests))
        num_top = max(requests[i].params.logprobs for i in rows)
        row_index = torch.tensor(rows, device=self.device)
        raw = logits[row_index].float().log_softmax(-1)  # [R, V]
        per_row = logprob_rows(raw, token_ids[row_index], num_top)  # [R, 2 + 2K]
        # The ids too, so that the host waits on a single copy.
        packed = torch.cat([token_ids.double(), per_row.flatten()]).tolist()
        batch_size = len(requests)
        token_list = [int(t) for t in packed[:batch_size]]
        logprobs: list[TokenLogprob | None] = [None] * batch_size
        width = 2 + 2 * num_top
        for r, i in enumerate(rows):
            row = packed[batch_size + r * width : batch_size + (r + 1) * width]
            logprobs[i] = token_logprob(token_list[i], row, num_top, requests[i].params.logprobs)
        return SamplerOutput(token_list, logprobs)

    def sample(
        self,
        logits: torch.Tensor,
        slots: np.ndarray,
        argmax: torch.Tensor | None = None,
        bitmask: BatchBitmask | None = None,
    ) -> torch.Tensor:
        """Next token ids [num_rows] int64, left on the device (no sync).

        logits: [num_rows, vocab_size], any float dtype, one row per slot; argmax: their
        argmax ids, if already taken (returned as is when nothing else applies); bitmask:
        the tokens the rows' grammars allow (structured outputs; grammar rows are never
        argmax_only)."""
        batch = self.batch
        if not batch.num_sampled_fully or np.count_nonzero(batch.argmax_only[slots]) == len(slots):
            return logits.argmax(-1) if argmax is None else argmax
        if bitmask is not None and self.batch.argmax_masked[slots].all():
            # Nothing else reads these logits (no logprobs are asked for).
            return bitmask.argmax(logits)
        requests = self._requests(slots)
        if bitmask is None and all(
            r.params.greedy_plain and not self._min_tokens_active(r) for r in requests
        ):
            return logits.argmax(-1) if argmax is None else argmax

        x = self.process_logits(logits, requests, bitmask)  # [B, V] fp32

        is_greedy = np.array([req.params.greedy for req in requests])
        if is_greedy.all():
            return x.argmax(-1)  # [B]
        if not is_greedy.any():
            return self._sample(x, requests, slots)
        # Masks and temperature never move the argmax, so greedy rows can take it now
        # and the random rows are sampled over the whole batch.
        greedy_ids = x.argmax(-1)
        mask = torch.from_numpy(is_greedy).to(self.device)  # [B]
        return torch.where(mask, greedy_ids, self._sample(x, requests, slots))

    def _requests(self, slots: np.ndarray) -> list[Request]:
        by_slot = self.batch.requests
        return [by_slot[s] or _VOID for s in slots.tolist()]

    def process_logits(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        bitmask: BatchBitmask | None = None,
        drafted: list[list[int]] | None = None,
    ) -> torch.Tensor:
        """The grammar mask, allowed_token_ids, bad_words, logit_bias, penalties and the
        min_tokens mask, on a new fp32 [B, V] tensor. drafted: a verify step's, per row,
        the drafts before its position, which count as generated there."""
        # Our own copy: the steps below write into it in place.
        x = logits.to(torch.float32, copy=True)  # [B, V]
        if bitmask is not None:
            bitmask.apply(x)
        self._apply_allowed(x, requests)
        self._apply_bad_words(x, requests, drafted)
        self._apply_logit_bias(x, requests)
        self._apply_penalties(x, requests, drafted)
        self._apply_min_tokens(x, requests, drafted)
        return x

    def _min_tokens_active(self, req: Request, drafted: int = 0) -> bool:
        params = req.params
        # Tokens still on the device count: the one sampled now comes after them.
        return req.num_generated_tokens + drafted < params.min_tokens and bool(
            self.eos_token_ids or params.stop_token_ids
        )

    def _apply_allowed(self, x: torch.Tensor, requests: Sequence[Request]) -> None:
        rows = [i for i, req in enumerate(requests) if req.params.allowed_token_ids]
        if not rows:
            return
        allowed = [requests[i].params.allowed_token_ids for i in rows]
        cols = [t for ids in allowed for t in ids]
        at = [r for r, ids in enumerate(allowed) for _ in ids]
        index = torch.tensor([at, cols], device=self.device)  # [2, num_allowed]
        keep = torch.zeros(len(rows), x.shape[1], dtype=torch.bool, device=self.device)
        keep[index[0], index[1]] = True
        row_index = torch.tensor(rows, device=self.device)
        x[row_index] = x[row_index].masked_fill(~keep, float("-inf"))

    def _apply_bad_words(
        self, x: torch.Tensor, requests: Sequence[Request], drafted: list[list[int]] | None
    ) -> None:
        rows, cols = [], []
        for i, req in enumerate(requests):
            spellings = req.params.bad_words_token_ids
            if spellings:
                generated = req.output_token_ids
                if drafted is not None and drafted[i]:
                    generated = generated + drafted[i]
                banned = banned_ids(spellings, generated)
                rows += [i] * len(banned)
                cols += banned
        if rows:
            index = torch.tensor([rows, cols], device=self.device)  # [2, num_banned]
            x[index[0], index[1]] = float("-inf")

    def _apply_logit_bias(self, x: torch.Tensor, requests: Sequence[Request]) -> None:
        rows, cols, values = [], [], []
        for i, req in enumerate(requests):
            for token_id, bias in (req.params.logit_bias or {}).items():
                rows.append(i)
                cols.append(token_id)
                values.append(bias)
        if rows:
            index = torch.tensor([rows, cols], device=self.device)  # [2, num_biases]
            bias = torch.tensor(values, dtype=x.dtype, device=self.device)
            x.index_put_((index[0], index[1]), bias, accumulate=True)

    def _apply_penalties(
        self, x: torch.Tensor, requests: Sequence[Request], drafted: list[list[int]] | None
    ) -> None:
        rows = [i for i, req in enumerate(requests) if req.params.has_penalties]
        if not rows:
            return
        params = [requests[i].params for i in rows]
        row_index = torch.tensor(rows, device=self.device)
        sub = x[row_index]  # [P, V]
        # [P, 3] -> three [P, 1] columns, one host-to-device copy
        values = [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params]
        penalties = torch.tensor(values, dtype=x.dtype, device=self.device)
        repetition, frequency, presence = penalties.T.unsqueeze(-1)

        # How often each vocabulary entry was generated (OpenAI's penalties
        # count output tokens only). Padding goes to an extra column V.
        generated_ids = [requests[i].output_token_ids for i in rows]
        if drafted is not None:
            generated_ids = [ids + drafted[i] for ids, i in zip(generated_ids, rows, strict=True)]
        output_ids = self._padded(generated_ids)  # [P, L]
        counts = torch.zeros(len(rows), self.vocab_size + 1, dtype=x.dtype, device=self.device)
        counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=x.dtype))
        counts = counts[:, : self.vocab_size]  # [P, V]
        generated = counts > 0

        if any(p.repetition_penalty != 1.0 for p in params):
            # HF/vLLM: over prompt and output tokens, shrink the logit toward
            # zero from either side (divide positive, multiply negative).
            prompt_ids = self._padded([requests[i].prompt_token_ids for i in rows])
            seen = torch.zeros(len(rows), self.vocab_size + 1, dtype=torch.bool, device=self.device)
            seen.scatter_(1, prompt_ids, True)
            seen = seen[:, : self.vocab_size] | generated  # [P, V]
            penalized = torch.where(sub > 0, sub / repetition, sub * repetition)
            sub = torch.where(seen, penalized, sub)
        sub -= frequency * counts + presence * generated
        x[row_index] = sub

    def _padded(self, token_lists: list[list[int]]) -> torch.Tensor:
        """Ragged token lists as one [len, max_len] int64 tensor, padded with vocab_size."""
        width = max(1, max(len(ids) for ids in token_lists))
        host = np.full((len(token_lists), width), self.vocab_size, dtype=np.int64)
        for row, ids in enumerate(token_lists):
            host[row, : len(ids)] = ids
        return torch.from_numpy(host).to(self.device)

    def _apply_min_tokens(
        self, x: torch.Tensor, requests: Sequence[Request], drafted: list[list[int]] | None
    ) -> None:
        rows, cols = [], []
        for i, req in enumerate(requests):
            if self._min_tokens_active(req, 0 if drafted is None else len(drafted[i])):
                # vLLM masks EOS here even with ignore_eos, and the stop ids too.
                banned = set(self.eos_token_ids) | set(req.params.stop_token_ids)
                rows += [i] * len(banned)
                cols += sorted(banned)
        if rows:
            index = torch.tensor([rows, cols], device=self.device)  # [2, num_banned]
            x[index[0], index[1]] = float("-inf")

    def verify(
        self,
        logits: torch.Tensor,
        slots: np.ndarray,
        drafts: np.ndarray,
        offsets: np.ndarray,
        argmax: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Speculative decoding's rows (engine/speculative.py): each row's own token, and
        whether the draft it checks stands. Returns (ids [R], accepted [R] bool), both on
        the device; accepted is None when every row is greedy: a greedy row accepts its
        draft if it is the argmax, which the caller sees from the ids.

        logits: [R, vocab] one row per position; slots: [R] each row's slot; drafts: [R]
        the draft token each row checks (-1: none); offsets: [R] each row's position among
        its sequence's (rows r - offsets[r] .. r - 1 check the drafts before it, which
        penalties and min_tokens count). A random row accepts its draft with
        probability p(draft) and otherwise samples from p without it: rejection sampling
        with a proposal certain of its draft, so that each position's token is
        distributed as p (Leviathan et al.)."""
        if np.count_nonzero(self.batch.argmax_only[slots]) == len(slots):
            return (logits.argmax(-1) if argmax is None else argmax), None
        requests = self._requests(slots)
        drafted = None  # penalties, min_tokens and bad words see the drafts before each row
        if any(
            r.params.has_penalties or r.params.min_tokens or r.params.bans_after_tokens
            for r in requests
        ):
            drafted = [drafts[r - o : r].tolist() for r, o in enumerate(offsets.tolist())]
        x = self.process_logits(logits, requests, drafted=drafted)  # [R, V] fp32
        greedy_ids = x.argmax(-1)
        is_greedy = np.array([req.params.greedy for req in requests])
        if is_greedy.all():
            return greedy_ids, None
        device = self.device
        drafts_t = torch.from_numpy(drafts).to(device)
        checks = drafts_t >= 0
        draft_ids = drafts_t.clamp(min=0)
        probs = self._probabilities(x, requests, slots)  # [R, V]
        # min-p leaves probs unnormalized: the race minds not, the acceptance does.
        p_draft = probs.gather(1, draft_ids[:, None]).squeeze(1) / probs.sum(-1)  # [R]
        uniform = torch.rand(p_draft.shape, generator=self.generator, device=device)
        random_accepts = checks & (uniform < p_draft)
        # The residual max(p - q, 0) of a one-hot proposal q: p without the draft.
        kept = probs.gather(1, draft_ids[:, None])
        probs.scatter_(1, draft_ids[:, None], torch.where(checks[:, None], 0.0, kept))
        greedy = torch.from_numpy(is_greedy).to(device)
        ids = torch.where(greedy, greedy_ids, self._race(probs, requests))
        return ids, torch.where(greedy, checks & (greedy_ids == draft_ids), random_accepts)

    def _sample(self, x: torch.Tensor, requests: list[Request], slots: np.ndarray) -> torch.Tensor:
        """Sample every row of x (greedy rows too; the caller discards those). Returns [B].

        Scales and masks x in place."""
        return self._race(self._probabilities(x, requests, slots), requests)

    def _probabilities(
        self, x: torch.Tensor, requests: list[Request], slots: np.ndarray
    ) -> torch.Tensor:
        """Each row's distribution after temperature, top-k, top-p and min-p ([B, V]; a
        greedy row's at temperature 1). Scales and masks x in place."""
        params = [req.params for req in requests]
        batch = self.batch
        top_k = batch.top_k[slots]
        top_k = np.where(top_k > 0, top_k, self.vocab_size)
        # One host-to-device copy for all per-row knobs; greedy rows hold neutral
        # values (temperature 1) so nothing divides by zero.
        knobs = np.stack(
            [batch.temperature[slots], top_k, batch.top_p[slots], batch.min_p[slots]]
        ).astype(np.float32)
        knobs = torch.from_numpy(knobs).to(self.device, x.dtype).unsqueeze(-1)  # [4, B, 1]
        temperature, top_k, top_p, min_p = knobs

        x.div_(temperature)
        use_top_k = any(0 < p.top_k < self.vocab_size for p in params)
        use_top_p = any(p.top_p < 1.0 for p in params)
        if use_top_k or use_top_p:
            x = _apply_top_k_top_p(x, top_k if use_top_k else None, top_p if use_top_p else None)
        probs = x.softmax(-1)  # [B, V]
        if any(p.min_p > 0.0 for p in params):
            # Drop tokens less likely than min_p times the most likely one.
            threshold = min_p * probs.amax(-1, keepdim=True)
            probs.masked_fill_(probs < threshold, 0.0)
        return probs

    def _race(self, probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """A token from each row of probs [B, V] (unnormalized is fine). Returns [B]."""
        params = [req.params for req in requests]
        # Exponential race: argmax(p / E), E ~ Exp(1), draws token i with
        # probability p_i, and needs no cumulative sum or host sync.
        noise = torch.empty_like(probs)  # [B, V]
        if any(p.seed is None and not p.greedy for p in params):
            noise.exponential_(generator=self.generator)
        for row, req in enumerate(requests):
            if req.params.seed is not None and not req.params.greedy:
                # A seeded row draws only from its own stream, so its tokens
                # do not depend on what else shares the batch.
                if req.generator is None:
                    req.generator = torch.Generator(device=self.device).manual_seed(req.params.seed)
                noise[row].exponential_(generator=req.generator)
        return probs.div_(noise).argmax(-1)


def logprob_rows(logprobs: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """[R, 2 + 2k] float64 (exact for ids, ranks and fp32 values, so one copy reads it
    back): each row's target logprob, its rank (1: the most likely), then the k most
    likely ids and their logprobs, best first. logprobs: [R, V] log_softmax; targets: [R]."""
    own = logprobs.gather(1, targets[:, None])  # [R, 1]
    rank = (logprobs > own).sum(-1, keepdim=True) + 1  # [R, 1]
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)  # [R, k]
    return torch.cat([t.double() for t in (own, rank, top_ids, top_logprobs)], dim=1)


def token_logprob(token_id: int, row: list[float], k: int, num_top: int) -> TokenLogprob:
    """A logprob_rows row read back, with the num_top (<= k) alternatives asked for."""
    top = zip(row[2 : 2 + num_top], row[2 + k : 2 + k + num_top], strict=True)
    return TokenLogprob(token_id, row[0], int(row[1]), [(int(t), lp) for t, lp in top])


def _apply_top_k_top_p(
    x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (to -inf) logits outside each row's top_k, then outside its top_p nucleus.

    x: [B, V]; top_k, top_p: [B, 1] (top_k == V means off; top_p == 1 means off).
    One ascending sort serves both: top_k keeps the last k columns, top_p drops
    the leading columns whose cumulative mass stays within 1 - top_p."""
    sorted_logits, order = x.sort(dim=-1)  # [B, V] ascending
    if top_k is not None:
        kth_col = (x.size(1) - top_k).long()  # [B, 1]
        kth_value = sorted_logits.gather(1, kth_col)
        # Ties with the k-th value survive, as in vLLM.
        sorted_logits.masked_fill_(sorted_logits < kth_value, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(-1).cumsum(-1)  # [B, V]
        outside = cumulative <= 1 - top_p
        outside[:, -1] = False  # the most likely token always survives
        sorted_logits.masked_fill_(outside, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_logits)
