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

The steady state (every running request decoding, nobody admitted, finished or
preempted since the last step) repeats the last batch one position on. It
begins right after a step that admitted prompts, too, when every one of them
was prefilled whole: that step's next is all decodes as well. Its starts are
advanced with numpy, only the requests that open a new block this step are
touched, and the requests' num_computed_tokens are written back from the starts
when the steady state ends. Anything else takes the general path.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from engine.config import EngineConfig
from engine.kv_cache import BlockManager
from engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """One step, in batch order (running requests, then those admitted), as parallel
    lists: a decode costs three appends, not an object."""

    requests: list[Request] = field(default_factory=list)
    # Tokens computed before: first new position (an int64 array in the steady state).
    starts: list[int] | np.ndarray = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    # Batch indices of prefill chunks that stop short of the request's tokens: they
    # sample nothing. Every other entry samples one token.
    chunked: list[int] = field(default_factory=list)
    # Batch indices of the requests that gained blocks: only their block-table rows
    # change. Those from first_admitted on were admitted now: their rows start empty.
    grown: list[int] = field(default_factory=list)
    first_admitted: int = 0
    preempted: list[Request] = field(default_factory=list)
    steady: bool = False  # the last batch (the same list), every request one token on
    # In a steady batch: the block each grown request opened, its one new block.
    opened: list[int] = field(default_factory=list)

    num_tokens: int = 0

    @property
    def is_decode_only(self) -> bool:
        return self.num_tokens == len(self.requests)

    def sampling(self) -> list[Request]:
        """The requests that sample this step, in batch order."""
        if not self.chunked:
            return self.requests
        chunked = set(self.chunked)
        return [req for i, req in enumerate(self.requests) if i not in chunked]

    def __bool__(self) -> bool:
        return bool(self.requests)


class Steady:
    """The steady state's bookkeeping, so that a step costs O(1) Python besides its
    batch: every start moves one on per step, so the first limit is `headroom` steps
    away, and a request opens a block every block_size steps, at a phase of its own:
    at the first step the requests are sorted by phase once (`order`, cut at
    `bounds`), and each step takes the group whose phase has come. Meanwhile
    `last + 1` is each request's num_computed_tokens; `settle` writes it back, and
    until then the requests' own counts lag (only the steady state runs, and it
    reads none of them).

    It begins after any step that ran every running request and left none short of
    its tokens: a step of decodes, or one that also prefilled whole prompts (the
    admissions' step), whose next token is a decode like the others'."""

    def __init__(self, out: SchedulerOutput) -> None:
        self.requests = out.requests
        # Per request, the position before the next step's: its last new token's.
        last = np.array(out.starts, dtype=np.int64)
        if out.num_tokens != len(out.requests):
            last += np.array(out.num_new_tokens, dtype=np.int64) - 1
        self.last = last
        self.ones = [1] * len(out.requests)
        maxes = np.array([req.max_num_tokens for req in out.requests], dtype=np.int64)
        self.headroom = int((maxes - last).min())  # min(max_num_tokens - last)
        self.steps = 0  # steps taken in the steady state
        self.order: np.ndarray | None = None  # batch indices by phase (see group)
        self.bounds: list[int] = []

    def group(self, block_size: int) -> None:
        """Sort the requests by the steps that open their blocks: request i's start at
        step s is last_i + s, which begins a block when s = -last_i (mod block_size)."""
        phase = -self.last & (block_size - 1)
        self.order = np.argsort(phase, kind="stable")  # batch order within a phase
        self.bounds = np.searchsorted(phase, np.arange(block_size + 1), sorter=self.order).tolist()

    def settle(self) -> None:
        """Write each request's num_computed_tokens back (one past its last position)."""
        for req, num_computed in zip(self.requests, (self.last + 1).tolist()):
            req.num_computed_tokens = num_computed


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0
        # Set when the last batch was all of `running`, decoding; cleared whenever
        # `running` changes.
        self._steady: Steady | None = None
        # Called when the steady state ends, before anything reads a request's token
        # counts: the engine's quiet runs defer them (engine.quiet_run).
        self.on_leave_steady: Callable[[], None] | None = None

    def add(self, req: Request) -> None:
        req.max_num_tokens = min(req.max_num_tokens, self.config.max_model_len)
        self.waiting.append(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        if self._steady is not None and not (self.waiting and self.free_slots):
            out = self._advance(self._steady)
            if out is not None:
                return out
        self._leave_steady()
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        # The hot loop (every running request, every step): locals and no calls for
        # the common case, a decode whose token lands in a block it already has.
        block_size = self.blocks.block_size
        running, requests = self.running, out.requests
        add_request, add_start = requests.append, out.starts.append
        add_count = out.num_new_tokens.append
        # Preemption only ever removes requests after this one: the iteration stays valid.
        for req in running:
            if budget <= 0:
                break
            start = req.num_computed_tokens
            num_tokens = len(req.all_token_ids) + req.num_inflight
            # start % block_size != 0: position start shares a block with start - 1.
            if num_tokens == start + 1 and start % block_size and num_tokens < req.max_num_tokens:
                req.num_computed_tokens = num_tokens
                add_request(req)
                add_start(start)
                add_count(1)
                budget -= 1
                continue
            if req.num_inflight and num_tokens >= req.max_num_tokens:
                continue  # its last token is on the device: it finishes when that is read
            # A block may have filled since req was last here: the fast path above
            # never crosses a block boundary.
            self.blocks.note_filled(req)
            if (
                num_tokens == start + 1
                and start == len(req.block_ids) * block_size
                and num_tokens < req.max_num_tokens
                and self.blocks.num_free_blocks
            ):  # a decode opening its next block (1 in block_size of them): as _advance does
                self.blocks.append_block(req)
                req.num_computed_tokens = num_tokens
                out.grown.append(len(requests))
                add_request(req)
                add_start(start)
                add_count(1)
                budget -= 1
                continue
            num_new = min(num_tokens - start, budget)
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
            self._add(out, req, num_new, grows)
            budget -= num_new

        out.first_admitted = len(requests)
        now = time.time()
        compiling: list[Request] = []  # structured outputs: grammar not compiled yet
        while self.waiting and budget > 0 and self.free_slots and not out.preempted:
            req = self.waiting[0]
            if req.structured is not None and not req.structured.ready():
                compiling.append(self.waiting.popleft())  # it waits; those behind it may go
                continue
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
            self._add(out, req, num_new, grown=True)
            budget -= num_new
        self.waiting.extendleft(reversed(compiling))
        out.num_tokens = self.config.max_num_batched_tokens - budget
        if requests and len(requests) == len(running) and not out.chunked and not out.preempted:
            self._steady = Steady(out)
        return out

    def _advance(self, steady: Steady) -> SchedulerOutput | None:
        """The steady state's next batch: the last one, every request one token on.

        Each request's token count is one past its last position (it sampled last
        step, and nothing since has finished, preempted or admitted anyone), so only
        block boundaries and length limits can differ from the last step; None when
        the general path must decide (a limit reached, or too few free blocks)."""
        steady.headroom -= 1
        if steady.headroom <= 1:
            return None  # a request reaches its limit: it is not scheduled again
        block_size = self.blocks.block_size
        if steady.order is None:
            steady.group(block_size)
        starts = steady.last + 1
        steady.steps += 1
        phase = steady.steps & (block_size - 1)
        lo, hi = steady.bounds[phase], steady.bounds[phase + 1]
        opening = steady.order[lo:hi].tolist() if hi > lo else []  # open a block now
        if len(opening) > self.blocks.num_free_blocks:
            return None  # someone may have to be preempted
        requests = steady.requests
        opened: list[int] = []
        if opening:
            reqs = [requests[i] for i in opening]
            if self.blocks.enable_prefix_caching:
                for i, req in zip(opening, reqs):
                    req.num_computed_tokens = int(starts[i])  # its count, for the cache
                    self.blocks.note_filled(req)  # the block it leaves is full now
            opened = self.blocks.open_blocks(reqs)  # checked above: there are enough
        out = SchedulerOutput(
            requests,
            starts,
            steady.ones,
            grown=opening,
            first_admitted=len(requests),
            steady=True,
            opened=opened,
        )
        out.num_tokens = len(requests)
        steady.last = starts
        return out

    @staticmethod
    def _add(out: SchedulerOutput, req: Request, num_new: int, grown: bool) -> None:
        """Schedule num_new more of req's tokens (the hot loop inlines the decode case)."""
        index = len(out.requests)
        start = req.num_computed_tokens
        req.num_computed_tokens = start + num_new
        out.requests.append(req)
        out.starts.append(start)
        out.num_new_tokens.append(num_new)
        if start + num_new < len(req.all_token_ids) + req.num_inflight:
            out.chunked.append(index)
        if grown:
            out.grown.append(index)

    @staticmethod
    def _prefilled(req: Request) -> bool:
        """Its prompt's blocks are in the prefix cache: its first token has been read."""
        return req.is_finished or req.num_output_tokens > 0

    def _leave_steady(self) -> None:
        if self._steady is not None:
            self._steady.settle()
            self._steady = None
            if self.on_leave_steady is not None:
                self.on_leave_steady()

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
            self._leave_steady()
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        self._release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        req.metrics.finished_time = time.time()
