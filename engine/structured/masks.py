"""GrammarMasks: a step's token bitmask, filled off the engine thread.

A grammar row's mask for step N depends on step N-1's id, which lands on the host
while the device runs forward N. When step N-1 is launched (`follow`), its grammar
rows' ids are copied to a pinned buffer of the masks' own, and a worker thread is
handed a job: wait for them, have the matchers accept them, and fill step N's masks,
each in its slot's host row (one xgrammar call each, which releases the GIL; the fill
splits the rows over xgrammar's threads). The worker starts the moment the ids land,
not when the engine thread gets to them; and as it takes the GIL back after each
call, the switch interval is lowered so that it never waits long behind the engine
thread's Python. A stop id ends its grammar (the mask allows one only there); an id
a matcher refuses (possible only when the mask allowed nothing) ends its request at
the next step's read, before its next id is read. The engine thread:

- `GrammarRows.completed` (as it reads N-1's ids, before it samples N): ends the
  requests a stop id completes;
- `build` (before the step samples): hands the worker the rows it could not know
  (a request's first sample, or one back from preemption) and the slots without a
  grammar now, to reset. Then it lets the step's copy go: on CUDA the stream waits
  for the worker's last job (device_flag.py) and the engine thread runs on;
  elsewhere the engine thread waits. The copy, the gather of the sampling rows'
  masks in the batch's order (none when they are the first slots, in order), and
  the sampler queue behind it.

The worker takes the GIL only around its xgrammar calls and makes no CUDA call but
the wait for the ids' event. Per-slot state (owners, which ended) lives in lists and
arrays by slot, set when a request's first mask is asked for, and is the engine
thread's; the worker sets `structured.done` for the matchers it ends.

Host rows are only written by the worker, after the step whose copy read them last
has sampled (its build waited for the worker's earlier jobs). The same holds for the
two id buffers: a grammar step's build makes the device wait for every earlier job,
so an id buffer is rewritten only after the job that read it two launches before.

Host rows are per slot and as wide as the tokenizer's vocabulary (what xgrammar
fills); device rows are as wide as the logits, and past the tokenizer a grammar
row's bits are 0 (the model's padding ids are masked) and a plain row's -1.
"""

from __future__ import annotations

import logging
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import xgrammar as xgr
from xgrammar.base import _core

from engine.structured.device_flag import DeviceFlag
from kernels.argmax import greedy_ids

if TYPE_CHECKING:
    from collections.abc import Sequence

    from engine.request import Request

logger = logging.getLogger("pagoda.engine")

# Rows per fill thread: a row costs microseconds, and a thread's start and join about
# as much as a few rows.
ROWS_PER_THREAD = 16
# The interpreter's switch interval while grammars run. A thread waiting for the GIL
# gets it when its holder blocks, or else after this long (5 ms by default): the
# worker waits so after each xgrammar call while the engine thread runs Python, and
# the device waits for the worker.
SWITCH_INTERVAL_S = 2e-5


def accept_all(handles: list, token_ids: list[int]) -> list[int] | None:
    """Each matcher (by its xgrammar handle) accepts its id, in one call that releases
    the GIL. None if all did; else whether each did ([0 or 1]). xgrammar's public
    batch_accept_token reads its result back one FFI call per row, each also releasing
    and taking the GIL again: its core call is used, and the result read only when it
    holds a refusal (one call for `in`)."""
    result = _core.BatchGrammarMatcher.batch_accept_token(handles, token_ids, False)
    return list(result) if 0 in result else None


@dataclass
class BatchBitmask:
    """A step's allowed tokens, one packed row per sampling request (all ones where the
    request has no grammar)."""

    bits: torch.Tensor  # [num_requests, ceil(vocab / 32)] int32, on the logits' device

    def apply(self, logits: torch.Tensor) -> None:
        """Disallowed tokens' logits to -inf, in place: one kernel on the device."""
        xgr.apply_token_bitmask_inplace(logits, self.bits)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's allowed id of the largest logit (apply, then argmax). On CUDA in
        one pass that reads the mask beside the logits and writes neither."""
        if not logits.is_cuda or logits.stride(-1) != 1:
            self.apply(logits)
            return logits.argmax(-1)
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        return greedy_ids(logits, out, self.bits)


@dataclass
class StepIds:
    """A launched step's ids as the worker reads them: `array` once `ready` has
    completed (None: there already), at `positions` (the live grammar rows'; None: all)."""

    array: np.ndarray
    ready: torch.cuda.Event | None
    positions: np.ndarray | None

    def wait(self) -> np.ndarray:
        if self.ready is not None and not self.ready.query():
            self.ready.synchronize()  # releases the GIL
        return self.array if self.positions is None else self.array[self.positions]


@dataclass
class GrammarRows:
    """A launched step's grammar rows: their slots, and which of the step's rows they
    are (None: all)."""

    masks: GrammarMasks
    slots: np.ndarray
    rows: np.ndarray | None

    def take_refused(self) -> list[tuple[Request, str]]:
        """Before the step's ids are read: the requests an earlier id of theirs ended
        (masks.take_refused)."""
        return self.masks.take_refused()

    def completed(self, ids: np.ndarray) -> list[tuple[Request, str]]:
        """The step's ids [one per row] read: the requests whose grammar they complete,
        which end with "stop" (the worker has the rest accepted)."""
        return self.masks.completed(self.slots, ids if self.rows is None else ids[self.rows])


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
        # The worker's: the host rows [slots, words].
        self.host = torch.full((max_num_seqs, self.words), -1, dtype=torch.int32, pin_memory=pin)
        self.host_np = self.host.numpy()
        # The engine thread's, by slot: whose rows they are, whether its matcher ended
        # (ids after, void), the device rows, whether the slot was a grammar's
        # at its last build (its host row filled, its padding bits 0), and the generation
        # whose next mask the worker was last asked to fill.
        self.owners: list[Request | None] = [None] * max_num_seqs
        self.ended = np.zeros(max_num_seqs, dtype=bool)
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
        # The launched steps' ids, for the worker: two buffers (masks.py's docstring).
        self.id_buffers = [
            torch.empty(max_num_seqs, dtype=torch.int64, pin_memory=pin) for _ in "ab"
        ]
        self.id_arrays = [buffer.numpy() for buffer in self.id_buffers]
        self.id_events = [torch.cuda.Event() for _ in "ab"] if pin else []
        self.num_followed = 0
        self.cuda_index = None
        if pin:
            index = self.device.index
            self.cuda_index = torch.cuda.current_device() if index is None else index
        self.worker = ThreadPoolExecutor(
            1, thread_name_prefix="pagoda-grammar-masks", initializer=self._start_worker
        )
        self.batch_matchers: dict[int, xgr.BatchGrammarMatcher] = {}  # by thread count
        # (slot, owner) of ids a matcher refused: the worker's, taken by the engine thread.
        self.refused: list[tuple[int, Request]] = []
        self.num_jobs = 0  # handed to the worker; each sets the flag to its number when done
        self.last: Future | None = None  # the worker's last job
        self.failure: BaseException | None = None  # a job's, raised by the next build
        self.flag = DeviceFlag.create(self.device)
        self.num_built = 0
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        if pin:  # Triton compiles the mask kernel at its first launch (one row, and more)
            for rows in (1, 2):
                BatchBitmask(self.rows[:rows]).apply(
                    torch.zeros(rows, vocab_size, device=self.device)
                )

    def _start_worker(self) -> None:
        """The worker waits for the ids' events on the engine's device (a thread's
        first CUDA call would otherwise make device 0's context)."""
        if self.cuda_index is not None:
            torch.cuda.set_device(self.cuda_index)

    # -- the worker's --------------------------------------------------------------

    def _job(
        self,
        number: int,
        owners: list[Request],
        slots: list[int],
        ids: StepIds | None,
        reset: list[int],
    ) -> None:
        """The owners' matchers accept their ids (if any: once they land), and fill
        their rows' next masks; rows in reset (no grammar now) go to all ones."""
        try:
            if reset:
                self.host_np[reset] = -1
            if ids is None:
                self.fill([owner.structured.matcher for owner in owners], slots)
            else:
                self._accept_and_fill(owners, slots, ids)
        except BaseException as exc:
            self.failure = exc
            raise
        finally:
            if self.flag is not None:  # even after a failure: the stream must go on
                self.flag.set(number)

    def _accept_and_fill(self, owners: list[Request], slots: list[int], step: StepIds) -> None:
        """What can be is done before the ids land, so that little Python (and GIL) is
        left between them and the masks."""
        # Ended by an id of an earlier job (refused): this one is void.
        done = [i for i, owner in enumerate(owners) if owner.structured.done]
        matchers = [owner.structured.matcher for owner in owners]
        handles = [matcher._handle for matcher in matchers]
        ids = step.wait()
        # A stop id completes its grammar (the engine thread ends the request): no next
        # mask, and its row goes to all ones, as do the void rows'.
        stops = self.is_stop[ids]
        if done or stops.any():
            stops[done] = True
            self.host_np[np.asarray(slots)[stops]] = -1
            go_on = np.flatnonzero(~stops).tolist()
            owners, slots = [owners[i] for i in go_on], [slots[i] for i in go_on]
            matchers, handles = [matchers[i] for i in go_on], [handles[i] for i in go_on]
            ids = ids[~stops]
        id_list = ids.tolist()
        refused = accept_all(handles, id_list)
        if refused is not None:
            go_on = [i for i, ok in enumerate(refused) if ok]
            for i in (i for i, ok in enumerate(refused) if not ok):
                # The mask allowed no other id: only a grammar that no token can continue
                # gets here (every logit masked). It ends that request, not the batch, at
                # the engine's next read; its next id is void.
                owner = owners[i]
                logger.error("%s: token %d is outside its grammar", owner.request_id, id_list[i])
                owner.structured.done = True
                self.host_np[slots[i]] = -1
                self.refused.append((slots[i], owner))
            matchers = [matchers[i] for i in go_on]
            slots = [slots[i] for i in go_on]
        self.fill(matchers, slots)

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

    # -- the engine thread's -------------------------------------------------------

    def _submit(
        self, owners: list[Request], slots: list[int], ids: StepIds | None, reset: list[int]
    ) -> None:
        self.num_jobs += 1
        self.last = self.worker.submit(self._job, self.num_jobs, owners, slots, ids, reset)

    def follow(
        self,
        slots: np.ndarray,
        generations: np.ndarray,
        grammar: np.ndarray,
        token_ids: torch.Tensor | np.ndarray,
    ) -> GrammarRows:
        """A launched step's grammar rows (one per slot; grammar: which rows have one)
        and its ids [one per row] (on the device, or read already): the worker has
        the live rows' matchers accept them once they land, and fills their next
        masks. The engine thread ends the requests they complete as it reads them
        (GrammarRows.completed)."""
        rows = None if grammar.all() else np.flatnonzero(grammar)
        if rows is not None:
            slots, generations = slots[rows], generations[rows]
        self.filled_generation[slots] = generations  # their next masks
        live = ~self.ended[slots]  # ended by an earlier id: this one is void
        positions = rows
        if not live.all():
            positions = (np.arange(len(slots)) if rows is None else rows)[live]
        slot_list = (slots if positions is rows else slots[live]).tolist()
        owners = [self.owners[slot] for slot in slot_list]
        self._submit(owners, slot_list, self._ids(token_ids, positions), [])
        return GrammarRows(self, slots, rows)

    def _ids(self, token_ids: torch.Tensor | np.ndarray, positions: np.ndarray | None) -> StepIds:
        """The step's ids on their way to the worker: on CUDA, copied to an id buffer
        of the masks' own (each launch the other one), behind an event."""
        if isinstance(token_ids, np.ndarray):
            return StepIds(token_ids.copy(), None, positions)
        if self.device.type != "cuda":
            return StepIds(token_ids.numpy().copy(), None, positions)
        self.num_followed += 1
        which = self.num_followed % 2
        n = token_ids.numel()
        host = self.id_buffers[which][:n]
        host.copy_(token_ids, non_blocking=True)
        ready = self.id_events[which]
        ready.record()
        return StepIds(self.id_arrays[which][:n], ready, positions)

    def take_refused(self) -> list[tuple[Request, str]]:
        """The requests whose id their matcher refused, found by the worker since the
        last call (their next ids are void: call before reading them)."""
        if not self.refused:
            return []
        refused, self.refused = self.refused, []
        ends = []
        for slot, owner in refused:
            if self.owners[slot] is owner:
                self.ended[slot] = True
            ends.append((owner, "abort"))
        return ends

    def completed(self, slots: np.ndarray, ids: np.ndarray) -> list[tuple[Request, str]]:
        """The requests whose grammar these slots' ids complete (a stop id: the mask
        allows one only there), which end with "stop"."""
        live = ~self.ended[slots]  # ended by an earlier id: this one is void
        if not live.all():
            slots, ids = slots[live], ids[live]
        stops = self.is_stop[ids]
        if not stops.any():
            return []
        ends = []
        for slot in slots[stops].tolist():
            owner = self.owners[slot]
            self.ended[slot] = owner.structured.done = True
            ends.append((owner, "stop"))
        return ends

    def build(
        self,
        slots: np.ndarray,
        generations: np.ndarray,
        grammar: np.ndarray,
        by_slot: Sequence[Request | None],
    ) -> BatchBitmask:
        """The bitmask of a batch of sampling rows (grammar: which rows have one, at
        least one; by_slot: the batch's requests), on the device. Every launched step
        with grammar rows must have been read."""
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
        """Take in the rows entering (the worker fills their first masks) and the slots
        leaving a grammar (the worker resets their host rows); set the padding bits of
        slots that changed."""
        stale_slots = slots[stale]
        self.filled_generation[stale_slots] = generations[stale]
        owners, fill_slots, reset = [], [], []
        for slot in stale_slots.tolist():
            owner = self.owners[slot] = by_slot[slot]
            self.ended[slot] = owner.structured.done
            if owner.structured.done:  # ended by an id not read yet: its row is void
                reset.append(slot)
            else:
                owners.append(owner)
                fill_slots.append(slot)
        if changed.any():
            which = slots[changed]
            self.grammar_slot[which] = grammar[changed]
            plain = slots[changed & ~grammar].tolist()
            if self.words < self.width:
                self._set_tails(which, grammar[changed])
            for slot in plain:  # a grammar's row before: all ones again
                self.owners[slot] = None
            reset += plain
        if fill_slots or reset:
            self._submit(owners, fill_slots, None, reset)

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
