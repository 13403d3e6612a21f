"""Who runs this step, and how many tokens each: continuous batching with chunked prefill.

Each step has a token budget (max_num_batched_tokens). Running requests go
first, in arrival order (decodes take one token, unfinished prefills a chunk);
then waiting requests are admitted while budget, sequence slots and KV blocks
last. When a running request cannot get a block, the newest running request
is preempted: its blocks are freed and it goes back to the front of the
queue, to be recomputed later (its full blocks usually survive in the prefix
cache, so recompute is cheap).

Scheduling runs one step ahead of the host's knowledge: a request's last
sampled token may still be on the device (num_inflight), and is scheduled
all the same; the model runner feeds it from the device. A request that has
reached its length limit with a token in flight is not scheduled again.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.kv_cache import BlockManager
from engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    start: int  # tokens computed before this step: the first new token's position
    samples: bool  # the step reaches the end of the request's tokens, so it samples one
    new_slot: bool = False  # admitted this step: its block-table row starts empty


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # The scheduled requests that gained blocks (the admitted ones among them): only
    # their block-table rows change this step.
    grown: list[ScheduledRequest] = field(default_factory=list)

    num_tokens: int = 0

    @property
    def is_decode_only(self) -> bool:
        return self.num_tokens == len(self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        req.max_num_tokens = min(req.max_num_tokens, self.config.max_model_len)
        self.waiting.append(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        # The hot loop (every running request, every step): locals, no calls
        # in the common case of a decode whose last block has room.
        block_size = self.blocks.block_size
        running, scheduled = self.running, out.scheduled
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            num_tokens = len(req.all_token_ids) + req.num_inflight
            if req.num_inflight and num_tokens >= req.max_num_tokens:
                i += 1  # its last token is on the device: it finishes when that is read
                continue
            start = req.num_computed_tokens
            num_new = num_tokens - start
            if num_new > budget:
                num_new = budget
            grows = start + num_new > len(req.block_ids) * block_size
            if grows:
                while not self.blocks.allocate(req, num_new):
                    victim = running[-1]
                    self._preempt(victim)
                    out.preempted.append(victim)
                    if victim is req:
                        break
                if req.status != RequestStatus.RUNNING:
                    break  # req preempted itself: everything after it is gone too
            req.num_computed_tokens = start + num_new
            entry = ScheduledRequest(req, num_new, start, start + num_new == num_tokens)
            scheduled.append(entry)
            if grows:
                out.grown.append(entry)
            budget -= num_new
            i += 1

        now = time.time()
        while self.waiting and budget > 0 and self.free_slots and not out.preempted:
            req = self.waiting[0]
            if req.num_inflight:
                break  # preempted with a token in flight: recompute once its id is known
            if req.wait_for is not None and not self._prefilled(req.wait_for):
                break  # FIFO: nothing overtakes a request held for its sibling
            cached = self.blocks.find_cached_prefix(req) if req.num_computed_tokens == 0 else []
            num_computed = len(cached) * self.blocks.block_size
            num_new = min(req.num_tokens - num_computed, budget)
            if not self.blocks.allocate(req, num_new, cached):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.slot = self.free_slots.pop()
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            self.running.append(req)
            entry = self._advance(req, num_new, new_slot=True)
            out.scheduled.append(entry)
            out.grown.append(entry)
            budget -= num_new
        out.num_tokens = self.config.max_num_batched_tokens - budget
        return out

    @staticmethod
    def _advance(req: Request, num_new: int, new_slot: bool = False) -> ScheduledRequest:
        start = req.num_computed_tokens
        req.num_computed_tokens += num_new
        samples = req.num_computed_tokens == len(req.all_token_ids) + req.num_inflight
        return ScheduledRequest(req, num_new, start, samples, new_slot)

    @staticmethod
    def _prefilled(req: Request) -> bool:
        """Its prompt's blocks are in the prefix cache: its first token has been read."""
        return req.is_finished or req.num_output_tokens > 0

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _release(self, req: Request) -> None:
        self.blocks.free(req)
        if req.slot >= 0:
            self.free_slots.append(req.slot)
            req.slot = -1

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """Take req out of the queues for good and free its blocks and slot."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        self._release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        req.metrics.finished_time = time.time()
