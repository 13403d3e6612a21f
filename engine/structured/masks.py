"""GrammarMasks: a step's token bitmask, filled off the engine thread.

A grammar row's mask for step N depends on step N-1's id, which lands on the host
while the device runs forward N. So the matchers' work runs on one worker thread,
in the order it is handed over:

- `follow` (after a step is launched): wait for its ids, have the rows' matchers
  accept them (the future it returns: the requests those ids ended), then fill the
  rows' next masks, each in its slot's host row;
- `build` (before a step samples): hand the worker what changed since the last
  step, if anything: rows it could not know (a request's first sample, or one back
  from preemption) to fill, and slots without a grammar now to reset. Then let the
  step's copy go: on CUDA the stream waits for the worker's last job
  (device_flag.py) and the engine thread runs on; elsewhere the engine thread
  waits. The copy, the gather of the sampling rows' masks in the batch's order (none
  when they are the first slots, in order), and the sampler queue behind it.

Both threads share the GIL, so each holds it as briefly as it can: per step the
engine thread does a few array operations and queues a job, and the worker makes
one xgrammar call for the whole batch's ids and one for its masks (each releases
the GIL), with array operations around them. Per-slot state lives in arrays and
lists by slot, set when a request's first mask is asked for, not rebuilt per step;
the worker's (matchers, owners, which ended) is only written by the worker, in job
order, so a job sees the slots as they were when it was queued.

Host rows are only written by the worker, after the step whose copy read them
last has been waited for (its ids, sampled after the copy).

Host rows are per slot and as wide as the tokenizer's vocabulary (what xgrammar
fills); device rows are as wide as the logits, and past the tokenizer a grammar
row's bits are 0 (the model's padding ids are masked) and a plain row's -1.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import xgrammar as xgr
from xgrammar.base import _core

from engine.staging import SampledIds
from engine.structured.device_flag import DeviceFlag

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from engine.request import Request

logger = logging.getLogger("pagoda.engine")

# Rows per fill thread: a row costs microseconds, and a thread's start and join about
# as much as a few rows.
ROWS_PER_THREAD = 16


def accept_all(matchers: list[xgr.GrammarMatcher], token_ids: list[int]) -> list[int] | None:
    """Each matcher accepts its id, in one call that releases the GIL. None if all did;
    else whether each did ([0 or 1]). xgrammar's public batch_accept_token reads its
    result back one FFI call per row, each also releasing and taking the GIL again:
    its core call is used, and the result read only when it holds a refusal (one
    call for `in`)."""
    result = _core.BatchGrammarMatcher.batch_accept_token(
        [m._handle for m in matchers], token_ids, False
    )
    return list(result) if 0 in result else None


@dataclass
class BatchBitmask:
    """A step's allowed tokens, one packed row per sampling request (all ones where the
    request has no grammar)."""

    bits: torch.Tensor  # [num_requests, ceil(vocab / 32)] int32, on the logits' device

    def apply(self, logits: torch.Tensor) -> None:
        """Disallowed tokens' logits to -inf, in place: one kernel on the device."""
        xgr.apply_token_bitmask_inplace(logits, self.bits)


class GrammarMasks:
    def __init__(
        self,
        token_vocab: int,
        vocab_size: int,
        max_num_seqs: int,
        device: torch.device,
        threads: int,
        stop_token_ids: Sequence[int],
    ) -> None:
        self.device = torch.device(device)
        self.words = xgr.get_bitmask_shape(1, token_vocab)[1]  # what xgrammar fills
        self.width = xgr.get_bitmask_shape(1, vocab_size)[1]  # what the logits need
        # A matcher ends by accepting one of these ids (and only so).
        self.is_stop = np.zeros(vocab_size, dtype=bool)
        self.is_stop[list(stop_token_ids)] = True
        pin = self.device.type == "cuda"
        # The worker's, by slot: the host rows [slots, words], and whose rows they are.
        self.host = torch.full((max_num_seqs, self.words), -1, dtype=torch.int32, pin_memory=pin)
        self.host_np = self.host.numpy()
        self.matchers: list[xgr.GrammarMatcher | None] = [None] * max_num_seqs
        self.owners: list[Request | None] = [None] * max_num_seqs
        self.ended = np.zeros(max_num_seqs, dtype=bool)  # its matcher ended: ids after, void
        # The engine thread's, by slot: the device rows, whether the slot was a grammar's
        # at its last build (its host row filled, its padding bits 0), and the generation
        # whose next mask the worker was last asked to fill.
        self.slots = torch.full((max_num_seqs, self.width), -1, dtype=torch.int32, device=device)
        self.grammar_slot = np.zeros(max_num_seqs, dtype=bool)
        self.filled_generation = np.full(max_num_seqs, -1, dtype=np.int64)
        self.rows = torch.empty_like(self.slots)  # the gathered mask, in sampling order
        # The sampling slots, on their way: two buffers, as a copy may wait a step.
        self.index = [torch.empty(max_num_seqs, dtype=torch.int64, pin_memory=pin) for _ in "ab"]
        self.device_index = torch.empty(max_num_seqs, dtype=torch.int64, device=device)
        self.indexed = np.zeros(0, dtype=np.int64)  # the slots device_index holds
        self.first_slots = np.arange(max_num_seqs, dtype=np.int64)
        self.threads = threads  # xgrammar's for a fill, at most
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="pagoda-grammar-masks")
        self.batch_matchers: dict[int, xgr.BatchGrammarMatcher] = {}  # by thread count
        self.num_jobs = 0  # handed to the worker; each sets the flag to its number when done
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

    def fill(self, matchers: list[xgr.GrammarMatcher], slots: list[int]) -> None:
        """Fill these matchers' host rows (each where its next id starts), in one
        xgrammar call that releases the GIL and splits the rows over its threads."""
        if not slots:
            return
        threads = min(self.threads, max(1, len(slots) // ROWS_PER_THREAD))
        batch = self.batch_matchers.get(threads)
        if batch is None:
            batch = self.batch_matchers[threads] = xgr.BatchGrammarMatcher(threads)
        batch.batch_fill_next_token_bitmask(matchers, self.host, slots)

    def _follow(
        self,
        number: int,
        ids: np.ndarray,
        landed: torch.cuda.Event | None,
        rows: np.ndarray | None,
        slots: np.ndarray,
        ended: Future,
    ) -> None:
        try:
            try:
                if landed is not None:
                    landed.synchronize()
                ids = ids[rows] if rows is not None else ids.copy()  # the buffer is reused
                live = ~self.ended[slots]  # ended by an earlier id: this one is void
                if not live.all():
                    slots, ids = slots[live], ids[live]
                slot_list = slots.tolist()
                matchers = [self.matchers[slot] for slot in slot_list]
                ends, over = self._accept(matchers, slots, ids)
            except BaseException as exc:
                ended.set_exception(exc)
                raise
            ended.set_result(ends)
            try:
                if over is None:
                    self.fill(matchers, slot_list)
                else:
                    go_on = np.flatnonzero(~over).tolist()
                    self.fill([matchers[i] for i in go_on], [slot_list[i] for i in go_on])
                    self.host_np[slots[over]] = -1  # the row's next id is void: any will do
            except BaseException as exc:
                self.failure = exc
                raise
        finally:
            self._done(number)

    def _accept(
        self, matchers: list[xgr.GrammarMatcher], slots: np.ndarray, ids: np.ndarray
    ) -> tuple[list[tuple[Request, str]], np.ndarray | None]:
        """The rows' matchers accept their ids: the requests this ends, and how; and
        which rows ended (None: none did)."""
        refused = accept_all(matchers, ids.tolist())
        stops = self.is_stop[ids]  # accepted: the grammar is complete
        if refused is None and not stops.any():
            return [], None
        over = stops if refused is None else stops | (np.array(refused) == 0)
        ends = []
        for i in np.flatnonzero(over).tolist():
            slot = int(slots[i])
            owner = self.owners[slot]
            if refused is not None and not refused[i]:
                # The mask allowed no other id. Only a grammar that no token can continue
                # gets here (every logit masked): end this request, not the batch.
                logger.error("%s: token %d is outside its grammar", owner.request_id, ids[i])
                reason = "abort"
            else:
                reason = "stop"
            self.ended[slot] = owner.structured.done = True
            ends.append((owner, reason))
        return ends, over

    def _prepare(
        self, number: int, entering: list[tuple[int, Request]], plain: np.ndarray | None
    ) -> None:
        try:
            slots, matchers = [], []
            for slot, owner in entering:
                state = owner.structured
                self.owners[slot], self.matchers[slot] = owner, state.matcher
                self.ended[slot] = state.done
                if state.done:  # ended by an id not read yet: its row is void
                    self.host_np[slot] = -1
                else:
                    slots.append(slot)
                    matchers.append(state.matcher)
            self.fill(matchers, slots)
            if plain is not None:  # a grammar's row before: all ones again
                self.host_np[plain] = -1
                for slot in plain.tolist():
                    self.owners[slot] = self.matchers[slot] = None
        except BaseException as exc:
            self.failure = exc
            raise
        finally:
            self._done(number)

    def _done(self, number: int) -> None:
        """A job is over (even after a failure: the stream must go on)."""
        if self.flag is not None:
            self.flag.set(number)

    # -- the engine thread's -------------------------------------------------------

    def _submit(self, job: Callable, *args) -> None:
        self.num_jobs += 1
        self.last = self.worker.submit(job, self.num_jobs, *args)

    def follow(
        self,
        ids: SampledIds | np.ndarray,
        slots: np.ndarray,
        generations: np.ndarray,
        grammar: np.ndarray,
    ) -> Future:
        """Have the worker accept a launched step's ids (one per slot; grammar: which
        rows have one) and fill the next masks. The future's result, once the ids are
        accepted: the requests whose grammar they ended, and how ([(req, reason)])."""
        if grammar.all():
            rows, slots = None, slots.copy()
        else:
            rows = np.flatnonzero(grammar)
            slots, generations = slots[rows], generations[rows]
        self.filled_generation[slots] = generations  # their next masks
        ended: Future = Future()
        ids, landed = ids.landing() if isinstance(ids, SampledIds) else (ids, None)
        self._submit(self._follow, ids, landed, rows, slots, ended)
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
        changed = self.grammar_slot[slots] != grammar
        if stale.any() or changed.any():
            self._prepare_rows(slots, generations, grammar, by_slot, stale, changed)
        self.num_built += 1
        num, top = len(slots), int(slots.max()) + 1
        if self.flag is None:
            self.drain()  # the host waits for the worker
        else:
            self.flag.wait(self.num_jobs)  # the stream does
        self.slots[:top, : self.words].copy_(self.host[:top], non_blocking=True)
        if top == num and np.array_equal(slots, self.first_slots[:num]):
            return BatchBitmask(self.slots[:num])  # the first slots, in order: no gather
        device_index = self.device_index[:num]
        if not np.array_equal(slots, self.indexed):
            index = self.index[self.num_built % 2][:num]
            index.numpy()[:] = slots
            device_index.copy_(index, non_blocking=True)
            self.indexed = slots.copy()
        torch.index_select(self.slots, 0, device_index, out=self.rows[:num])
        return BatchBitmask(self.rows[:num])

    def _prepare_rows(
        self,
        slots: np.ndarray,
        generations: np.ndarray,
        grammar: np.ndarray,
        by_slot: Sequence[Request | None],
        stale: np.ndarray,
        changed: np.ndarray,
    ) -> None:
        """Hand the worker the rows entering (their first masks) and the slots leaving
        a grammar (their host rows reset); set the padding bits of slots that changed."""
        stale_slots = slots[stale]
        self.filled_generation[stale_slots] = generations[stale]
        entering = [(slot, by_slot[slot]) for slot in stale_slots.tolist()]
        plain = None
        if changed.any():
            which = slots[changed]
            self.grammar_slot[which] = grammar[changed]
            plain = slots[changed & ~grammar]
            if self.words < self.width:
                self._set_tails(which, grammar[changed])
            if not len(plain):
                plain = None
        if entering or plain is not None:
            self._submit(self._prepare, entering, plain)

    def _set_tails(self, slots: np.ndarray, grammar: np.ndarray) -> None:
        """The padding bits of these slots: 0 for a grammar's, -1 otherwise."""
        for value, kind in ((0, True), (-1, False)):
            which = slots[grammar == kind]
            if len(which):
                rows = torch.from_numpy(which).to(self.device, non_blocking=True)
                self.slots[rows, self.words :] = value

    def drain(self) -> None:
        """Wait for the worker's last job (and raise what it raised)."""
        if self.last is not None:
            self.last.result()
            self.last = None

    def close(self) -> None:
        self.worker.shutdown(wait=False, cancel_futures=True)
        if self.flag is not None:  # a cancelled job's wait must not hold the stream
            self.flag.set(self.num_jobs)
