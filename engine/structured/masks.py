"""GrammarMasks: a step's token bitmask, each grammar row's filled as soon as it can be.

A row's mask for step N depends on step N-1's id, which lands on the host while
the device runs forward N. The engine thread has its own work then (the outputs,
the next schedule, the launch, the read), so the matchers' part runs on a worker
thread: `follow` hands it a launched step's ids, and it waits for them, has each
row's matcher accept its id, and fills the masks of the rows that go on, each in
its slot's host row. xgrammar releases the GIL in both, so the two threads
overlap. `build` then has the engine thread fill only the rows the worker could
not know (a request's first sample, or one that came back after preemption), and
gathers the sampling rows' masks on the device in the batch's order.

Host rows are per slot and as wide as the tokenizer's vocabulary (what xgrammar
fills); device rows are as wide as the logits, and past the tokenizer a grammar
row's bits are 0 (the model's padding ids are masked) and a plain row's -1.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import xgrammar as xgr

from engine.staging import SampledIds

if TYPE_CHECKING:
    from engine.request import Request
    from engine.structured.grammars import GrammarState

logger = logging.getLogger("pagoda.engine")
# Rows per fill thread: a row costs microseconds, and a thread's start and join about
# as much as a few rows.
ROWS_PER_THREAD = 16


@dataclass
class BatchBitmask:
    """A step's allowed tokens, one packed row per sampling request (all ones where the
    request has no grammar)."""

    bits: torch.Tensor  # [num_requests, ceil(vocab / 32)] int32, on the logits' device

    def apply(self, logits: torch.Tensor) -> None:
        """Disallowed tokens' logits to -inf, in place: one kernel on the device."""
        xgr.apply_token_bitmask_inplace(logits, self.bits)


@dataclass
class FollowedRow:
    """A launched grammar row: where its id is in the step's ids, and whose it is."""

    index: int
    slot: int
    generation: int
    request: Request


class GrammarMasks:
    def __init__(
        self,
        token_vocab: int,
        vocab_size: int,
        max_num_seqs: int,
        device: torch.device,
        threads: int,
    ) -> None:
        self.device = torch.device(device)
        self.words = xgr.get_bitmask_shape(1, token_vocab)[1]  # what xgrammar fills
        self.width = xgr.get_bitmask_shape(1, vocab_size)[1]  # what the logits need
        pin = self.device.type == "cuda"
        # [slots, words]: written only once the device copied it out (a step's ids
        # are waited for first, and the copy was queued before their sampling).
        self.host = torch.full((max_num_seqs, self.words), -1, dtype=torch.int32, pin_memory=pin)
        self.host_np = self.host.numpy()
        self.host_grammar = np.zeros(max_num_seqs, dtype=bool)  # host row holds a grammar's
        self.slots = torch.full((max_num_seqs, self.width), -1, dtype=torch.int32, device=device)
        self.tail_grammar = np.zeros(max_num_seqs, dtype=bool)  # its padding bits are 0
        self.rows = torch.empty_like(self.slots)  # the gathered mask, in sampling order
        self.index = torch.empty(max_num_seqs, dtype=torch.int64, pin_memory=pin)
        self.index_np = self.index.numpy()
        self.device_index = torch.empty(max_num_seqs, dtype=torch.int64, device=device)
        self.threads = threads
        self.batch_matchers: dict[int, xgr.BatchGrammarMatcher] = {}  # by thread count
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="pagoda-grammar-masks")
        self.followed: Future | None = None  # the worker's last job
        if pin:  # Triton compiles the mask kernel at its first launch (one row, and more)
            for rows in (1, 2):
                BatchBitmask(self.rows[:rows]).apply(
                    torch.zeros(rows, vocab_size, device=self.device)
                )

    def fill(self, states: Sequence[GrammarState], slots: list[int], generations) -> None:
        """Fill these states' host rows (their matchers are where the next id starts)."""
        if not slots:
            return
        threads = min(self.threads, max(1, len(slots) // ROWS_PER_THREAD))
        batch = self.batch_matchers.get(threads)
        if batch is None:
            batch = self.batch_matchers[threads] = xgr.BatchGrammarMatcher(threads)
        matchers = [s.matcher for s in states]
        batch.batch_fill_next_token_bitmask(matchers, self.host, slots)
        self.host_grammar[slots] = True
        for state, slot, generation in zip(states, slots, generations):
            state.mask_key = (slot, generation)

    # -- the worker ------------------------------------------------------------

    def follow(
        self,
        ids: SampledIds | np.ndarray,
        slots: np.ndarray,
        generations: np.ndarray,
        requests: Sequence[Request | None],
    ) -> Future:
        """Have the worker accept a launched step's ids (one per slot; requests: the
        slots' as sampled) and fill the next masks. The future's result: the requests
        whose grammar those ids ended, and how ([(req, reason)])."""
        rows = [
            FollowedRow(i, slot, generation, req)
            for i, (slot, generation, req) in enumerate(
                zip(slots.tolist(), generations.tolist(), requests)
            )
            if req is not None and not req.is_finished and req.structured is not None
        ]
        self.followed = self.worker.submit(self._follow, ids, rows)
        return self.followed

    def _follow(self, ids: SampledIds | np.ndarray, rows: list[FollowedRow]):
        token_ids = (ids.wait_elsewhere() if isinstance(ids, SampledIds) else ids).tolist()
        ended: list[tuple[Request, str]] = []
        go_on: list[FollowedRow] = []
        for row in rows:  # accept_token each: batch_accept_token's result costs more
            end = row.request.structured.accept(token_ids[row.index])
            if end is None:
                go_on.append(row)
            else:
                ended.append((row.request, end))
        self.fill(
            [r.request.structured for r in go_on],
            [r.slot for r in go_on],
            [r.generation for r in go_on],
        )
        return ended

    def drain(self) -> None:
        """Wait for the worker's last job: its rows are written, its matchers moved."""
        if self.followed is not None:
            self.followed.result()
            self.followed = None

    # -- a step's mask -----------------------------------------------------------

    def build(
        self, slots: np.ndarray, generations: np.ndarray, requests: Sequence[Request | None]
    ) -> BatchBitmask | None:
        """The bitmask of a batch of sampling rows (None for a void request), on the
        device; None if no row has a live grammar. Every read id must have been
        accepted (the launched steps read)."""
        self.drain()
        grammar = np.zeros(len(slots), dtype=bool)
        stale: list[GrammarState] = []
        stale_slots: list[int] = []
        stale_generations: list[int] = []
        for i, (slot, generation, req) in enumerate(
            zip(slots.tolist(), generations.tolist(), requests)
        ):
            state = req.structured if req is not None else None
            if state is None or not state.live or req.is_finished:
                continue
            grammar[i] = True
            if state.mask_key != (slot, generation):
                stale.append(state)
                stale_slots.append(slot)
                stale_generations.append(generation)
        if not grammar.any():
            return None
        self.fill(stale, stale_slots, stale_generations)
        plain = slots[~grammar]
        plain = plain[self.host_grammar[plain]]  # a grammar's row before: all ones again
        self.host_np[plain] = -1
        self.host_grammar[plain] = False
        if self.words < self.width:
            self._set_tails(slots, grammar)
        num, top = len(slots), int(slots.max()) + 1
        self.index_np[:num] = slots
        if self.device.type == "cpu":
            self.slots[:top, : self.words] = self.host[:top]
            torch.index_select(self.slots, 0, self.index[:num], out=self.rows[:num])
        else:
            self.slots[:top, : self.words].copy_(self.host[:top], non_blocking=True)
            index = self.device_index[:num]
            index.copy_(self.index[:num], non_blocking=True)
            torch.index_select(self.slots, 0, index, out=self.rows[:num])
        return BatchBitmask(self.rows[:num])

    def _set_tails(self, slots: np.ndarray, grammar: np.ndarray) -> None:
        """The padding bits of rows that changed kind: 0 for a grammar's, -1 otherwise."""
        changed = self.tail_grammar[slots] != grammar
        if not changed.any():
            return
        for value, kind in ((0, True), (-1, False)):
            which = slots[changed & (grammar == kind)]
            if len(which):
                rows = torch.from_numpy(which).to(self.device)
                self.slots[rows, self.words :] = value
                self.tail_grammar[which] = kind

    def close(self) -> None:
        self.worker.shutdown(wait=False, cancel_futures=True)
