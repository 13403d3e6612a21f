"""Who runs this step, and how many tokens each: continuous batching with chunked prefill.

Each step has a token budget (max_num_batched_tokens). Running requests go
first, in arrival order (decodes take one token, unfinished prefills a chunk);
then waiting requests are admitted while budget, sequence slots and KV blocks
last. When a running request cannot get a block, the newest running request
is preempted: its blocks are freed and it goes back to the front of the
queue, to be recomputed later (its full blocks usually survive in the prefix
cache, so recompute is cheap). Under the "priority" policy the queue is ordered by
(priority, arrival) instead, and the victim is the last running request in that order.

The running requests' part is array operations over the InputBatch's columns
(every running request, every step); only requests that need a block, and
those admitted, are visited one by one.

Scheduling runs one step ahead of the host's knowledge: a request's last
sampled token may still be on the device (num_tokens > num_known), and is
scheduled all the same; the model runner feeds it from the device. A request
that has reached its length limit with a token in flight is not scheduled
again: it finishes when that token is read.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from engine.block_table import BlockTable
from engine.config import EngineConfig
from engine.images import keep_images_whole
from engine.input_batch import CAPACITY, COMPUTED, KNOWN, LIMIT, NO_LIMIT, TOKENS, InputBatch
from engine.kv_cache import BlockManager
from engine.request import Request, RequestStatus
from engine.state_snapshots import StateCopies, StateSnapshots


@dataclass
class SchedulerOutput:
    """One step, in batch order (running requests, then those admitted)."""

    slots: np.ndarray  # [num_seqs] int64: each sequence's InputBatch and block-table row
    starts: np.ndarray  # [num_seqs] int64: tokens computed before this step
    num_new_tokens: np.ndarray  # [num_seqs] int64
    num_known: np.ndarray  # [num_seqs] int64: tokens whose ids the host has
    # [num_seqs] bool: the chunk reaches the request's last token, so it samples the
    # next one (every sequence but prefill chunks that stop short).
    samples: np.ndarray
    num_tokens: int = 0
    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # [num_seqs] int64: tokens computed after this step (starts + num_new_tokens).
    seq_lens: np.ndarray | None = None
    num_sampling: int = -1  # sequences that sample (-1: count `samples`)
    # InputBatch.layout when the sequences are all its running requests (their slots
    # are the batch's `slots`), else None: what was derived from those slots holds.
    layout: int | None = None
    # [num_seqs] int64: draft tokens each sequence verifies after its last sampled one
    # (engine/speculative.py); None: no sequence has any.
    num_drafts: np.ndarray | None = None
    # Recurrent states copied between slots and snapshots (engine/state_snapshots.py).
    state_copies: StateCopies | None = None

    def __post_init__(self) -> None:
        self.num_seqs = num_seqs = len(self.slots)
        if self.seq_lens is None:
            self.seq_lens = self.starts + self.num_new_tokens
        if self.num_sampling < 0:
            self.num_sampling = np.count_nonzero(self.samples)
        # One token each, and each samples: a one-token prefill chunk that stops short
        # of its prompt's end (a budget's last token) is no decode.
        self.is_decode_only = self.num_tokens == num_seqs == self.num_sampling
        # The rows that sample, in batch order: where their ids land in the step's output.
        every = self.num_sampling == num_seqs
        self.sampling_slots = self.slots if every else self.slots[self.samples]
        # Logits rows: one per sampling sequence, and one more per draft it verifies.
        self.num_logits = self.num_sampling
        if self.num_drafts is not None:
            self.num_logits += int(self.num_drafts.sum())
        # Every token is a decode's or a draft's, each a logits row: they attend as
        # decode rows of their own (AttentionMetadata.per_token).
        self.verifies_only = self.num_drafts is not None and self.num_logits == self.num_tokens

    def __bool__(self) -> bool:
        return self.num_seqs > 0


def _bars_drafts(req: Request) -> bool:
    """Its steps sample as no speculative step does: under a grammar's mask, scoring its
    prompt, or taking its embedding (engine/speculative.py)."""
    return req.structured is not None or req.scores_prompt or req.params.pooling


def _rank(req: Request) -> tuple[int, float]:
    """A request's place under the priority policy: lower priority values first, then
    earlier arrivals."""
    return req.params.priority, req.metrics.arrival_time


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        batch: InputBatch,
        block_table: BlockTable,
    ) -> None:
        self.config = config
        self.blocks = block_manager
        self.batch = batch
        self.block_table = block_table
        self.waiting: deque[Request] = deque()
        self.by_priority = config.scheduling_policy == "priority"
        self.whole_pooling = config.whole_pooling_prompts
        self.num_preemptions = 0
        # `samples` of a step whose every sequence samples (read-only).
        self.every_row = np.ones(config.max_num_seqs, dtype=bool)
        self.every_row.flags.writeable = False
        self.block_shift, self.block_mask = block_table.block_shift, block_table.block_mask
        self.snapshots = (
            StateSnapshots(config.max_num_seqs + 1, config.state_snapshots, config.block_size)
            if config.state_snapshots
            else None
        )

    @property
    def running(self) -> list[Request]:
        return self.batch.running

    def add(self, req: Request) -> None:
        # A pooling request's one sampled token is dropped, never computed: its prompt
        # may fill the context.
        limit = self.config.max_model_len + (1 if req.params.pooling else 0)
        req.max_num_tokens = min(req.max_num_tokens, limit)
        self._enqueue(req, front=False)

    def _enqueue(self, req: Request, front: bool) -> None:
        """Into the waiting queue: at its end (a new request) or front (a preempted one),
        or, by priority, after every request that comes before it in (priority, arrival)."""
        if not self.by_priority:
            self.waiting.appendleft(req) if front else self.waiting.append(req)
            return
        key, i = _rank(req), len(self.waiting)
        while i and _rank(self.waiting[i - 1]) > key:  # new arrivals: usually none to pass
            i -= 1
        self.waiting.insert(i, req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.batch)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        preempted: list[Request] = []
        slots, counts, num_new, ends, num_scheduled, whole = self._schedule_running(
            budget, preempted
        )
        admitted: list[Request] = []
        if self.waiting and num_scheduled < budget and self.batch.free_slots and not preempted:
            self._admit(budget - num_scheduled, admitted)
            if admitted:
                new_slots = np.array([req.slot for req in admitted], dtype=np.int64)
                new_counts = self.batch.counts[:, new_slots]
                new_num = new_counts[TOKENS] - new_counts[COMPUTED]
                new_num[-1] = min(new_num[-1], budget - num_scheduled - new_num[:-1].sum())
                if self.snapshots is not None:  # as _admit cut them
                    self.snapshots.cut(new_slots, new_counts[COMPUTED], new_num)
                if self.batch.num_whole_images:  # as _admit cut it
                    keep_images_whole(self.batch, new_slots, new_counts[COMPUTED], new_num)
                slots = np.concatenate([slots, new_slots])
                counts = np.concatenate([counts, new_counts], axis=1)
                num_new = np.concatenate([num_new, new_num])
                ends = counts[COMPUTED] + num_new
                if self.batch.num_draft_tokens and any(map(_bars_drafts, admitted)):
                    # Its first token needs the step's ordinary sampling: no drafts.
                    num_new -= np.maximum(ends - counts[TOKENS], 0)
                    ends = counts[COMPUTED] + num_new
                    self.batch.num_draft_tokens = 0
                num_scheduled = int(num_new.sum())
                whole = False
        self.batch.scheduled(slots, ends, num_scheduled)
        num_seqs = len(slots)
        snapshots = self.snapshots
        copies = None if snapshots is None else snapshots.step(slots, ends)
        known, num_drafts = counts[KNOWN], None
        if self.batch.num_draft_tokens:  # what the budget left of them
            num_drafts = np.maximum(ends - counts[TOKENS], 0)
            if num_drafts.any():
                known = known + num_drafts  # the host wrote them: staged from its ids
            else:
                num_drafts = None
        return SchedulerOutput(
            slots,
            counts[COMPUTED],
            num_new,
            known,
            self.every_row[:num_seqs] if whole else ends >= counts[TOKENS],
            num_scheduled,
            admitted,
            preempted,
            ends,
            num_seqs if whole else -1,
            # Always a subsequence of the batch's slots, in order: all of them, if as many.
            self.batch.layout if num_seqs == len(self.batch) else None,
            num_drafts,
            copies,
        )

    def _schedule_running(
        self, budget: int, preempted: list[Request]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, bool]:
        """(slots, their InputBatch counts, num_new_tokens, the tokens computed after this
        step, the tokens scheduled, whether each gets all its tokens) of the running
        requests that get tokens."""
        batch = self.batch
        slots = batch.slots
        counts = batch.counts.take(slots, axis=1)  # [7, n]: one gather for every column
        computed, num_tokens = counts[COMPUTED], counts[TOKENS]
        num_new = num_tokens - computed
        whole = True  # every one gets all its tokens: ends are num_tokens
        if batch.num_draft_tokens:  # and its drafts after them (engine/speculative.py)
            num_new += batch.num_drafts[slots]
            whole = False
        snapshots = self.snapshots
        if snapshots is not None and snapshots.pending and snapshots.cut(slots, computed, num_new):
            whole = False  # prefill chunks that end at their save points
        if batch.headroom <= 0:  # the bound says nothing: measure it
            room = counts[LIMIT] - num_tokens
            batch.headroom = int(np.minimum.reduce(room, initial=NO_LIMIT))
            # Its last token (at the length limit) is on the device: it finishes when read.
            if batch.headroom <= 0:
                whole = False
                num_new[room <= 0] = 0
        total = batch.num_unscheduled if whole else int(np.add.reduce(num_new))
        if total > budget:  # first come, first served; one chunk crosses the line
            before = np.cumsum(num_new) - num_new
            np.minimum(num_new, np.maximum(budget - before, 0), out=num_new)
            whole = False
        if not whole and batch.num_whole_images:  # no chunk ends inside an image
            keep_images_whole(batch, slots, computed, num_new)
        ends = num_tokens if whole else computed + num_new
        # The requests whose new tokens reach past their blocks (a decode opens one in
        # every block_size steps).
        grows = ends > counts[CAPACITY]
        if np.count_nonzero(grows):
            self._grow(grows.nonzero()[0], counts, ends, preempted)
            if preempted:  # dropped below
                num_new[~np.isin(slots, batch.slots)] = 0
                whole = False
        if not whole:
            keep = num_new > 0
            slots, counts, num_new, ends = slots[keep], counts[:, keep], num_new[keep], ends[keep]
            total = int(np.add.reduce(num_new))
        return slots, counts, num_new, ends, total, whole

    def _grow(
        self, rows: np.ndarray, counts: np.ndarray, ends: np.ndarray, preempted: list[Request]
    ) -> None:
        """Blocks for the running requests at `rows` (batch indices) to hold their
        tokens up to `ends`, preempting the newest (or, by priority, the last in
        priority order) when there are too few."""
        running = self.batch.running
        reqs = [running[i] for i in rows.tolist()]
        # The last block of each may be full now: the prefix cache may have it.
        self.blocks.note_filled(reqs)
        # Capacities are whole blocks: (ends - capacity) / block_size, rounded up.
        need = (ends[rows] - counts[CAPACITY][rows] + self.block_mask) >> self.block_shift
        fresh = self.blocks.grow(reqs, need.tolist())
        if fresh is not None:  # the usual case: blocks for everyone
            grown = self.batch.slots[rows]
            if len(fresh) == len(reqs):  # one each: decodes opening their next block
                self.block_table.append_one(grown, fresh)
            else:
                for req in reqs:
                    self.block_table.update_row(req.slot, req.block_ids)
            self.batch.capacity[grown] += need << self.block_shift
            return
        num_new = ends - counts[COMPUTED]
        live = RequestStatus.RUNNING
        for i, req in zip(rows.tolist(), reqs):
            while req.status is live and not self.blocks.allocate(req, int(num_new[i])):
                victim = max(running, key=_rank) if self.by_priority else running[-1]
                self._preempt(victim)
                preempted.append(victim)
            if req.status is live:  # not preempted (by itself, or for one before it)
                self._update_blocks(req)

    def _update_blocks(self, req: Request) -> None:
        self.block_table.update_row(req.slot, req.block_ids)
        self.batch.capacity[req.slot] = len(req.block_ids) * self.blocks.block_size

    def _admit(self, budget: int, admitted: list[Request]) -> None:
        """Admit waiting requests while budget, slots and blocks last (FIFO)."""
        now = time.time()
        batch = self.batch
        compiling: list[Request] = []  # its grammar is not compiled yet
        while self.waiting and budget > 0 and batch.free_slots:
            req = self.waiting[0]
            if req.structured is not None and not req.structured.ready():
                compiling.append(self.waiting.popleft())  # it waits; those behind it may go
                continue
            if req.num_inflight:
                break  # preempted with a token in flight: recompute once its id is known
            first = req.wait_for  # its prompt's blocks are cached once its first id is read
            if first is not None and not (first.is_finished or first.num_output_tokens):
                break  # FIFO: nothing overtakes a request held for its sibling
            # Prompt logprobs need the logits at every prompt position, and CLS or MEAN
            # pooling (or an encoder) every prompt token's state: no cache hits.
            whole = self.whole_pooling and req.params.pooling
            fresh = req.num_computed_tokens == 0 and not req.scores_prompt and not whole
            cached = self.blocks.find_cached_prefix(req) if fresh else []
            bs, snapshots, save_points = self.blocks.block_size, self.snapshots, []
            if snapshots is not None and fresh:  # from the last saved state on
                found = len(cached)
                cached = snapshots.usable(cached, self.blocks.block_hash)
                self.blocks.prefix_hits -= (found - len(cached)) * bs
                save_points = snapshots.save_points(req, len(cached) * bs, found * bs)
            num_computed = len(cached) * bs
            todo = min(req.num_tokens - num_computed, budget)
            if save_points:
                todo = min(todo, save_points[0] - num_computed)
            images, cut = req.images, False
            if images is not None and images.run_starts is not None:  # runs stay whole
                room = todo
                todo = images.chunk_end(num_computed, num_computed + room) - num_computed
                if todo == 0:
                    break  # it waits for a step with room for its image
                cut = todo < room  # the last admitted: schedule() cuts it again
            if whole and todo < req.num_tokens - num_computed:
                break  # not chunked: it waits for a step with room for all of it
            if not self.blocks.allocate(req, todo, cached):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            slot = batch.add(req)
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            self.block_table.clear_row(slot)
            self._update_blocks(req)
            if snapshots is not None:
                key = self.blocks.block_hash[cached[-1]] if cached else None
                snapshots.admit(req, slot, key, save_points)
            admitted.append(req)
            budget -= todo
            if cut:
                break
        self.waiting.extendleft(reversed(compiling))

    def _preempt(self, req: Request) -> None:
        if self.snapshots is not None:
            self.snapshots.drop(req.slot)
        self.batch.remove(req)
        self.blocks.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        self._enqueue(req, front=True)
        self.num_preemptions += 1

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """Take req out of the queues for good and free its blocks and slot."""
        # Finished first: its ids on the device are void.
        status, req.status = req.status, RequestStatus.FINISHED
        if status is RequestStatus.RUNNING:
            self.blocks.free(req)  # registers what it filled: reads its row
            if self.snapshots is not None:
                self.snapshots.drop(req.slot)
            self.batch.remove(req)
        elif status is not RequestStatus.FINISHED:  # waiting or preempted
            self.waiting.remove(req)
            self.blocks.free(req)
        req.finish_reason = reason
        req.stop_reason = stop_reason
        req.metrics.finished_time = time.time()
