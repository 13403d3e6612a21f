"""GrammarMasks: a step's token bitmask, from the masks' worker (mask_worker.py).

A grammar row's mask for step N depends on step N-1's id, which lands on the host
while the device runs forward N. When step N-1 is launched, `follow` has its grammar
rows' ids copied for the worker, which has the matchers accept them as they land
and fills step N's masks in the slots' host rows. A step with grammar rows reads
N-1's ids before it samples (engine.py), and the engine thread:

- `take_refused`, then `GrammarRows.completed` (as it reads N-1's ids): ends the
  requests whose matcher refused an earlier id, and those whose grammar a stop id
  completes; their later ids are void;
- `build` (before the step samples): hands the worker the rows it could not know
  (a request's first sample, or one back from preemption) and the slots without a
  grammar now, to reset. Then it lets the sampler go: on CUDA a copy stream waits
  for the worker's jobs and copies the host rows to the device beside the forward
  (the bus is the slow part: a sampler reading the host rows itself took longer than
  the copy and a device read together), the sampling stream waits for the copy,
  and the engine thread runs on; elsewhere the engine thread waits. Greedy rows
  take the masked argmax from the copied rows by slot (no gather), into the device
  rows the next step's inputs are read from. Other rows have them gathered in the
  batch's order (no gather when they are the first slots, in order), and the mask
  applied to the logits.

Per-slot state (owners, which ended) lives in lists and arrays by slot, set when a
request's first mask is asked for, and is the engine thread's.

Host rows are per slot and as wide as the tokenizer's vocabulary (what xgrammar
fills); device rows are as wide as the logits, and past the tokenizer a grammar
row's bits are 0 (the model's padding ids are masked) and a plain row's -1 (the
masked argmax takes that word per row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import xgrammar as xgr

from engine.cuda_graphs import capturing
from engine.structured.mask_worker import MaskWorker
from kernels.argmax import MaskRows, argmax_parts, greedy_ids

if TYPE_CHECKING:
    from collections.abc import Sequence

    from engine.request import Request


# Masked argmax graphs kept at most (each a few launches' worth of device memory).
MAX_ARGMAX_GRAPHS = 512


@dataclass
class BatchBitmask:
    """A step's allowed tokens, one packed row per sampling row (all ones where the
    row has no grammar): the rows' slots' host rows, as the worker fills them."""

    masks: GrammarMasks
    slots: np.ndarray  # each row's
    grammar: np.ndarray  # [rows] bool: which have one (their padding ids disallowed)

    def bits(self) -> torch.Tensor:
        """The rows copied to the logits' device: [rows, ceil(vocab / 32)] int32."""
        return self.masks.device_bits(self.slots)

    def apply(self, logits: torch.Tensor) -> None:
        """Disallowed tokens' logits to -inf, in place: one kernel on the device."""
        xgr.apply_token_bitmask_inplace(logits, self.bits())

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's allowed id of the largest logit (apply, then argmax). On CUDA in
        one pass that reads the host rows beside the logits and writes neither."""
        if not logits.is_cuda or logits.stride(-1) != 1:
            self.apply(logits)
            return logits.argmax(-1)
        return self.masks.greedy(logits, self.slots, self.grammar)


@dataclass
class GrammarRows:
    """A launched step's grammar rows: their slots, and which of the step's rows they
    are (None: all)."""

    masks: GrammarMasks
    slots: np.ndarray
    rows: np.ndarray | None

    def completed(self, ids: np.ndarray) -> list[tuple[Request, str]]:
        """The step's ids [one per row] read: the requests whose grammar they complete (a
        stop id: the mask allows one only there), which end with "stop" (the worker has
        the rest accepted)."""
        masks, slots = self.masks, self.slots
        ids = ids if self.rows is None else ids[self.rows]
        live = ~masks.ended[slots]  # ended by an earlier id: this one is void
        if not live.all():
            slots, ids = slots[live], ids[live]
        stops = masks.is_stop[ids]
        if not stops.any():
            return []
        ends = []
        for slot in slots[stops].tolist():
            owner = masks.owners[slot]
            masks.ended[slot] = owner.structured.done = True
            ends.append((owner, "stop"))
        return ends


class GrammarMasks:
    def __init__(
        self,
        token_vocab: int,
        vocab_size: int,
        max_num_seqs: int,
        device: torch.device,
        threads: int,
        stop_token_ids: Sequence[int],
        logits_dtype: torch.dtype = torch.float32,
        ids_out: torch.Tensor | None = None,  # [max_num_seqs] int64: where argmax writes
    ) -> None:
        self.device = torch.device(device)
        self.words = xgr.get_bitmask_shape(1, token_vocab)[1]  # what xgrammar fills
        self.width = xgr.get_bitmask_shape(1, vocab_size)[1]  # what the logits need
        # A matcher ends by accepting one of these ids (and only so).
        self.is_stop = np.zeros(vocab_size, dtype=bool)
        self.is_stop[list(stop_token_ids)] = True
        pin = self.device.type == "cuda"
        self.worker = MaskWorker(self.words, max_num_seqs, self.device, threads, self.is_stop)
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
        # The host rows' device copy, by slot, and the stream that copies them. One copy
        # serves: a grammar step's build comes after the previous steps' ids were read,
        # so after every launch that read the copy before.
        self.table = self.worker.host
        self.copy_stream = self.copied = None
        if pin:
            self.table = torch.empty_like(self.worker.host, device=self.device)
            self.copy_stream = torch.cuda.Stream(self.device)
            self.copied = torch.cuda.Event()
        # The sampling slots, on their way: two buffers, as a copy may wait a step.
        self.index = [torch.empty(max_num_seqs, dtype=torch.int64, pin_memory=pin) for _ in "ab"]
        self.device_index = torch.empty(max_num_seqs, dtype=torch.int64, device=device)
        self.indexed = np.zeros(0, dtype=np.int64)  # the slots device_index holds
        self.first_slots = np.arange(max_num_seqs, dtype=np.int64)
        self.num_built = 0
        # The masked argmax's (CUDA's path; elsewhere only tests call it): each row's slot
        # and padding word (MaskRows.select), staged as the index is; its partials; and
        # where its ids go, viewed apart from the runner's graph rows (keep_sampled tells
        # them apart).
        self.select_host = [
            torch.empty(2, max_num_seqs, dtype=torch.int32, pin_memory=pin) for _ in "ab"
        ]
        self.select = torch.empty(2, max_num_seqs, dtype=torch.int32, device=device)
        self.selected: tuple[np.ndarray, np.ndarray] | None = None  # what select holds
        self.parts = argmax_parts(max_num_seqs, vocab_size, self.device)
        # The masked argmax's launches as CUDA graphs, by logits (pointer, shape, row
        # stride, dtype): a replay costs the engine thread less than two Triton launches,
        # and a grammar step's host work is what its step waits for. A graph is captured
        # the second time its logits are seen (decode graphs' logits are), up to
        # MAX_ARGMAX_GRAPHS; the other steps launch the kernels.
        self.argmax_graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.seen_logits: set[tuple] = set()
        self.capture_stream = torch.cuda.Stream(self.device) if pin else None
        if ids_out is None:
            ids_out = torch.empty(max_num_seqs, dtype=torch.int64, device=device)
        self.ids_out = [ids_out[:k] for k in range(max_num_seqs + 1)]
        if pin:
            # Triton compiles the mask kernels at their first launch.
            for rows in (1, 2):  # one row, and more
                logits = torch.zeros(rows, vocab_size, dtype=logits_dtype, device=self.device)
                every = np.arange(rows)
                self.greedy(logits, every, every > 0)  # greedy rows: the model's dtype
                BatchBitmask(self, every, every > 0).apply(logits.float())  # the rest: fp32

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
        self.worker.submit(owners, slot_list, self.worker.step_ids(token_ids, positions), [])
        return GrammarRows(self, slots, rows)

    def take_refused(self) -> list[tuple[Request, str]]:
        """The requests whose id their matcher refused, found by the worker since the
        last call (their next ids are void: call before reading them)."""
        ends = []
        for slot, owner in self.worker.take_refused():
            if self.owners[slot] is owner:
                self.ended[slot] = True
            ends.append((owner, "abort"))
        return ends

    def build(
        self,
        slots: np.ndarray,
        generations: np.ndarray,
        grammar: np.ndarray,
        by_slot: Sequence[Request | None],
    ) -> BatchBitmask:
        """The bitmask of a batch of sampling rows (grammar: which rows have one, at
        least one; by_slot: the batch's requests): their slots' host rows, which the
        device reads once the worker's jobs are done. Every launched step with grammar
        rows must have been read. The worker is first handed the rows entering (it
        fills their first masks) and the slots leaving a grammar (it resets them)."""
        owners, fill_slots, reset = [], [], []
        # A row the worker was not asked to fill for this slot's request: its first.
        stale = grammar & (self.filled_generation[slots] != generations)
        if stale.any():
            stale_slots = slots[stale]
            self.filled_generation[stale_slots] = generations[stale]
            for slot in stale_slots.tolist():
                owner = self.owners[slot] = by_slot[slot]
                self.ended[slot] = owner.structured.done
                if owner.structured.done:  # ended by an id not read yet: its row is void
                    reset.append(slot)
                else:
                    owners.append(owner)
                    fill_slots.append(slot)
        changed = self.grammar_slot[slots] != grammar
        if changed.any():
            which = slots[changed]
            self.grammar_slot[which] = grammar[changed]
            if self.words < self.width:  # the padding bits: 0 for a grammar's, -1 otherwise
                for value, kind in ((0, True), (-1, False)):
                    tails = which[grammar[changed] == kind]
                    if len(tails):
                        rows = torch.from_numpy(tails).to(self.device, non_blocking=True)
                        self.slots[rows, self.words :] = value
            plain = slots[changed & ~grammar].tolist()
            for slot in plain:  # a grammar's row before: all ones again
                self.owners[slot] = None
            reset += plain
        if fill_slots or reset:
            self.worker.submit(owners, fill_slots, None, reset)
        self.num_built += 1
        self._copy_rows(int(slots.max()) + 1)
        return BatchBitmask(self, slots, grammar)

    def _copy_rows(self, top: int) -> None:
        """The sampling stream waits for every job handed over (the host waits, where
        there is no device flag) and, on CUDA, for the host rows of the slots below
        `top` copied to `table` once they are: on the copy stream, which does not wait
        for the forward."""
        if self.copy_stream is None:
            self.worker.hold()
            return
        sampling = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.copy_stream):
            self.worker.hold()
            self.table[:top].copy_(self.worker.host[:top], non_blocking=True)
            self.copied.record()
        sampling.wait_event(self.copied)

    def greedy(self, logits: torch.Tensor, slots: np.ndarray, grammar: np.ndarray) -> torch.Tensor:
        """The masked argmax of rows [len(slots), vocab], a kernel reading each row's
        slot's row of the device copy (BatchBitmask.argmax's path on CUDA)."""
        num = len(slots)
        select = self.select[:, :num]
        if self.selected is None or not (
            np.array_equal(slots, self.selected[0]) and np.array_equal(grammar, self.selected[1])
        ):
            host = self.select_host[self.num_built % 2][:, :num]
            rows = host.numpy()
            rows[0] = slots
            rows[1] = np.where(grammar, 0, -1)  # a grammar's padding ids: disallowed
            select.copy_(host, non_blocking=True)
            self.selected = slots.copy(), grammar.copy()
        out, mask = self.ids_out[num], MaskRows(self.table, select)
        if self.capture_stream is None:  # Triton's interpreter (tests)
            return greedy_ids(logits, out, mask, self.parts)
        key = (logits.data_ptr(), *logits.shape, logits.stride(0), logits.dtype)
        graph = self.argmax_graphs.get(key)
        if graph is None:
            if key not in self.seen_logits or len(self.argmax_graphs) >= MAX_ARGMAX_GRAPHS:
                if len(self.seen_logits) >= 4 * MAX_ARGMAX_GRAPHS:
                    self.seen_logits.clear()  # eager steps' logits, mostly
                self.seen_logits.add(key)
                return greedy_ids(logits, out, mask, self.parts)
            graph = self.argmax_graphs[key] = torch.cuda.CUDAGraph()
            # The worker may wait on its events meanwhile: only this thread's calls are
            # held to the capture's rules. The kernels allocate nothing.
            with capturing(graph, None, self.capture_stream, error_mode="thread_local"):
                greedy_ids(logits, out, mask, self.parts)
        graph.replay()
        return out

    def device_bits(self, slots: np.ndarray) -> torch.Tensor:
        """These slots' rows on the device, gathered in order: [len(slots), width] int32."""
        num, top = len(slots), int(slots.max()) + 1
        self.slots[:top, : self.words].copy_(self.table[:top], non_blocking=True)
        if top == num and np.array_equal(slots, self.first_slots[:num]):
            return self.slots[:num]  # the first slots, in order: no gather
        device_index = self.device_index[:num]
        if not np.array_equal(slots, self.indexed):
            index = self.index[self.num_built % 2][:num]
            index.numpy()[:] = slots
            device_index.copy_(index, non_blocking=True)
            self.indexed = slots.copy()
        torch.index_select(self.slots, 0, device_index, out=self.rows[:num])
        return self.rows[:num]
