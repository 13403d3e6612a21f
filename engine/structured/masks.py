"""GrammarMasks: a step's token bitmask, filled off the engine thread.

A grammar row's mask for step N depends on step N-1's id, which lands on the host
while the device runs forward N. So the matchers' work runs on one worker thread,
in the order it is handed over:

- `follow` (after a step is launched): wait for its ids, have each row's matcher
  accept its id (the future it returns: the requests those ids ended), then fill
  the rows' next masks, each in its slot's host row;
- `build` (before a step samples): fill the rows the worker could not know (a
  request's first sample, or one back from preemption), reset the host rows of
  slots without a grammar now, then let the step's copy go: on CUDA the stream
  waits for the worker (device_flag.py) and the engine thread runs on; elsewhere
  the engine thread waits. The copy, the gather of the sampling rows' masks in
  the batch's order, and the sampler queue behind it.

xgrammar releases the GIL in both, so the worker and the engine thread overlap.
Host rows are only written by the worker, after the step whose copy read them
last has been waited for (its ids, sampled after the copy).

Host rows are per slot and as wide as the tokenizer's vocabulary (what xgrammar
fills); device rows are as wide as the logits, and past the tokenizer a grammar
row's bits are 0 (the model's padding ids are masked) and a plain row's -1.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import xgrammar as xgr

from engine.staging import SampledIds
from engine.structured.device_flag import DeviceFlag

if TYPE_CHECKING:
    from engine.request import Request
    from engine.structured.grammars import GrammarState

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
        # The worker's: [slots, words], and which rows hold a grammar's mask.
        self.host = torch.full((max_num_seqs, self.words), -1, dtype=torch.int32, pin_memory=pin)
        self.host_np = self.host.numpy()
        self.host_grammar = np.zeros(max_num_seqs, dtype=bool)
        # The engine thread's: the device rows by slot, and whose padding bits are 0.
        self.slots = torch.full((max_num_seqs, self.width), -1, dtype=torch.int32, device=device)
        self.tail_grammar = np.zeros(max_num_seqs, dtype=bool)
        # By slot: the generation whose next mask the worker was last asked to fill.
        self.filled_generation = np.full(max_num_seqs, -1, dtype=np.int64)
        self.rows = torch.empty_like(self.slots)  # the gathered mask, in sampling order
        # The sampling slots, on their way: two buffers, as a copy may wait a step.
        self.index = [torch.empty(max_num_seqs, dtype=torch.int64, pin_memory=pin) for _ in "ab"]
        self.device_index = torch.empty(max_num_seqs, dtype=torch.int64, device=device)
        self.threads = threads
        self.batch_matchers: dict[int, xgr.BatchGrammarMatcher] = {}  # by thread count
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="pagoda-grammar-masks")
        self.last: Future | None = None  # the worker's last job
        self.failure: BaseException | None = None  # a job's, raised by the next build
        self.flag = DeviceFlag.create(self.device)
        self.num_built = 0
        if pin:  # Triton compiles the mask kernel at its first launch (one row, and more)
            for rows in (1, 2):
                BatchBitmask(self.rows[:rows]).apply(
                    torch.zeros(rows, vocab_size, device=self.device)
                )

    # -- the worker's --------------------------------------------------------------

    def fill(self, states: Sequence[GrammarState], slots: list[int]) -> None:
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

    def _follow(
        self,
        ids: np.ndarray,
        landed: torch.cuda.Event | None,
        rows: list[FollowedRow],
        ended: Future,
    ) -> None:
        try:
            if landed is not None:
                landed.synchronize()
            token_ids = ids.tolist()
            ends: list[tuple[Request, str]] = []
            go_on: list[FollowedRow] = []
            stopped: list[int] = []
            for row in rows:  # accept_token each: batch_accept_token's result costs more
                state = row.request.structured
                # Ended by an earlier id: this one is void (the engine learns it later).
                end = "void" if state.done else state.accept(token_ids[row.index])
                if end is None:
                    go_on.append(row)
                else:
                    stopped.append(row.slot)
                    if end != "void":
                        ends.append((row.request, end))
        except BaseException as exc:
            ended.set_exception(exc)
            raise
        ended.set_result(ends)
        try:
            self.fill([r.request.structured for r in go_on], [r.slot for r in go_on])
            self.host_np[stopped] = -1  # the row's next id is void: any will do
        except BaseException as exc:
            self.failure = exc
            raise

    def _prepare(
        self, states: list[GrammarState], slots: list[int], plain: np.ndarray, n: int
    ) -> None:
        try:
            ended = [slot for state, slot in zip(states, slots) if state.done]
            if ended:  # ended by an id not read yet: its row is void
                self.host_np[ended] = -1
                states = [state for state in states if not state.done]
                slots = [slot for slot in slots if slot not in ended]
            self.fill(states, slots)
            plain = plain[self.host_grammar[plain]]  # a grammar's row before: all ones again
            self.host_np[plain] = -1
            self.host_grammar[plain] = False
        except BaseException as exc:
            self.failure = exc
            raise
        finally:
            if self.flag is not None:  # even after a failure: the stream must go on
                self.flag.set(n)

    # -- the engine thread's -------------------------------------------------------

    def follow(
        self,
        ids: SampledIds | np.ndarray,
        slots: np.ndarray,
        generations: np.ndarray,
        grammar: np.ndarray,
        by_slot: Sequence[Request | None],
    ) -> Future:
        """Have the worker accept a launched step's ids (one per slot; grammar: which
        rows have one; by_slot: the batch's requests) and fill the next masks. The
        future's result, once the ids are accepted: the requests whose grammar they
        ended, and how ([(req, reason)])."""
        index = np.flatnonzero(grammar)
        grammar_slots = slots[index]
        rows = [
            FollowedRow(i, slot, by_slot[slot])
            for i, slot in zip(index.tolist(), grammar_slots.tolist())
        ]
        self.filled_generation[grammar_slots] = generations[index]  # their next masks
        ended: Future = Future()
        landing = ids.landing() if isinstance(ids, SampledIds) else (ids, None)
        self.last = self.worker.submit(self._follow, *landing, rows, ended)
        return ended

    def build(
        self,
        slots: np.ndarray,
        generations: np.ndarray,
        grammar: np.ndarray,
        by_slot: Sequence[Request | None],
    ) -> BatchBitmask:
        """The bitmask of a batch of sampling rows (grammar: which rows have one, at
        least one; by_slot: the batch's requests), on the device. Every launched step
        must have been followed."""
        if self.failure is not None:
            raise self.failure
        # A row the worker was not asked to fill for this slot's request: its first.
        stale = grammar & (self.filled_generation[slots] != generations)
        stale_slots = slots[stale]
        self.filled_generation[stale_slots] = generations[stale]
        states = [by_slot[slot].structured for slot in stale_slots.tolist()]
        self.num_built += 1
        self.last = self.worker.submit(
            self._prepare, states, stale_slots.tolist(), slots[~grammar], self.num_built
        )
        if self.words < self.width:
            self._set_tails(slots, grammar)
        num, top = len(slots), int(slots.max()) + 1
        index = self.index[self.num_built % 2][:num]
        index.numpy()[:] = slots
        if self.flag is None:
            self.drain()  # the host waits for the worker
        else:
            self.flag.wait(self.num_built)  # the stream does
        self.slots[:top, : self.words].copy_(self.host[:top], non_blocking=True)
        device_index = self.device_index[:num]
        device_index.copy_(index, non_blocking=True)
        torch.index_select(self.slots, 0, device_index, out=self.rows[:num])
        return BatchBitmask(self.rows[:num])

    def _set_tails(self, slots: np.ndarray, grammar: np.ndarray) -> None:
        """The padding bits of rows that changed kind: 0 for a grammar's, -1 otherwise."""
        changed = self.tail_grammar[slots] != grammar
        if not changed.any():
            return
        for value, kind in ((0, True), (-1, False)):
            which = slots[changed & (grammar == kind)]
            if len(which):
                rows = torch.from_numpy(which).to(self.device, non_blocking=True)
                self.slots[rows, self.words :] = value
                self.tail_grammar[which] = kind

    def drain(self) -> None:
        """Wait for the worker's last job (and raise what it raised)."""
        if self.last is not None:
            self.last.result()
            self.last = None

    def close(self) -> None:
        self.worker.shutdown(wait=False, cancel_futures=True)
        if self.flag is not None:  # a cancelled job's wait must not hold the stream
            self.flag.set(self.num_built)
