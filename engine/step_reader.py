"""Reading a launched step's ids: into the batch, then their consequences for the few
rows that have any (first tokens, stops by id, length or stop string, ended grammars,
and the news of streamed requests). The engine launches steps; this is what it does
with their ids once they are on the host."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from engine.config import EngineConfig
from engine.input_batch import InputBatch, LaunchMark, ReadTokens
from engine.kv_cache import BlockManager
from engine.outputs import detokenize
from engine.pooling import PooledRows
from engine.prompt_logprobs import PromptScoring
from engine.request import Request, RequestStatus, TokenLogprob
from engine.scheduler import Scheduler
from engine.staging import SampledIds

if TYPE_CHECKING:  # xgrammar is imported with the first structured request
    from engine.structured.masks import GrammarRows


@dataclass
class LaunchedStep:
    """A step's sampled ids: the rows that sampled them (slots, and the batch as they
    saw it), and the ids (on their way, or read with their logprobs)."""

    slots: np.ndarray
    mark: LaunchMark
    token_ids: SampledIds | np.ndarray
    logprobs: list[TokenLogprob | None] | None = None
    # Its grammar rows, whose grammars the ids may complete
    grammar: GrammarRows | None = None
    # Its pooling rows' embeddings, on the host once its ids are (engine/pooling.py)
    pooled: PooledRows | None = None


class StepReader:
    def __init__(
        self,
        batch: InputBatch,
        blocks: BlockManager,
        scheduler: Scheduler,
        eos_set: frozenset[int],
        config: EngineConfig,  # its stream_interval, read at every step
        trace: Callable[[str], AbstractContextManager],  # NVTX ranges, or none
    ) -> None:
        self.batch = batch
        self.blocks = blocks
        self.scheduler = scheduler
        self.eos_set = eos_set
        self.config = config
        self._range = trace
        self.requests: dict[str, list[Request]] = {}  # client id -> its n choices
        self.news: dict[Request, None] = {}  # requests with output not taken yet (ordered)

    def read(self, step: LaunchedStep) -> None:
        """Read a launched step's ids into the batch; apply stops; note the news."""
        with self._range("read"):
            ids = step.token_ids
            if isinstance(ids, SampledIds):
                if not ids.ready():
                    self.blocks.hash_unhashed()  # work that can wait, while the device runs
                ids = ids.numpy()
            if step.pooled is not None:  # before the requests finish: their last output has them
                pooled = step.pooled
                for req, embedding in zip(pooled.requests, pooled.vectors.tolist(), strict=True):
                    req.embedding = embedding
            if step.logprobs is not None:  # before any request can finish: its last output has them
                self._keep_logprobs(step)
            grammar = step.grammar
            if grammar is not None:  # ended by an earlier id: this one is void
                self._end_grammars(grammar.masks.take_refused())
            got = self.batch.read(step.slots, step.mark, ids)
            # The worker accepts the grammar rows' ids itself; here, the ends they make.
            ended = grammar.completed(ids) if grammar is not None else None
            if got is not None:
                self._apply(got, ended)
            elif ended:  # its rows may all have left since
                self._end_grammars(ended)

    def _keep_logprobs(self, step: LaunchedStep) -> None:
        batch = self.batch
        generations = step.mark.generations.tolist()
        for slot, gen, logprob in zip(step.slots.tolist(), generations, step.logprobs):
            req = batch.requests[slot]
            if logprob is not None and req is not None and batch.generation[slot] == gen:
                req.pending_logprobs.append(logprob)

    def keep_prompt_logprobs(self, scores: PromptScoring) -> None:
        batch = self.batch
        for slot, first, entries in zip(scores.slots, scores.firsts, scores.entries, strict=True):
            req = batch.requests[slot]
            req.add_prompt_logprobs(first, entries)
            if not req.scores_prompt:
                batch.prompt_scored(slot)

    def keep_embeddings(self, pooled: PooledRows) -> None:
        """Note the step's pooling rows' requests (their embeddings are read with the
        step's ids); their rows pool no more."""
        batch = self.batch
        pooled.requests = [batch.requests[slot] for slot in pooled.slots]
        for slot in pooled.slots:
            batch.pooled(slot)

    def _apply(self, got: ReadTokens, ended: list[tuple[Request, str]] | None) -> None:
        """The read ids' consequences, for the few rows that have any: first tokens,
        stops, and the news of streamed requests."""
        batch = self.batch
        by_slot = batch.requests
        if got.first is not None:
            now = time.time()
            for slot in got.slots[got.first].tolist():
                req = by_slot[slot]
                req.metrics.first_token_time = now
                # A sibling choice waits for the prompt's blocks to be findable.
                self.blocks.cache_full_blocks(req)
                if req.params.plain:  # its first output is news; the rest, columns'
                    self.news[req] = None
                    batch.first_read(slot)
        if got.done is not None:
            for slot, token_id in zip(
                got.slots[got.done].tolist(), got.token_ids[got.done].tolist()
            ):
                self._check_token_stop(by_slot[slot], token_id)
        for req, token_id in got.departed:  # preempted: waiting to be recomputed
            if not req.is_finished:
                self._check_token_stop(req, token_id)
            if req.params.plain and not req.num_emitted_tokens:  # maybe its first id
                self.news[req] = None
        if ended:  # after the stops: a stop id ends it first
            self._end_grammars(ended)
        if not got.streamed:
            return
        interval = self.config.stream_interval
        news = self.news
        if interval == 1 and not batch.num_matching:  # each streamed row's id is news
            news.update(dict.fromkeys(got.streamed))  # (a finished one's is noted already)
            return
        finished = RequestStatus.FINISHED
        for req in got.streamed:
            if req.status is finished:
                continue  # its news is noted already
            params = req.params
            if params.stop:  # a stop string must end it now, not when asked
                stop_string = detokenize(req)
                if stop_string is not None:
                    self.finish(req, "stop", stop_string)
                if req.status is finished or params.final_only:
                    continue
            # Streamed: every `interval` tokens, the first at once.
            emitted = req.num_emitted_tokens
            if interval == 1 or not emitted or len(req.output_ids) - emitted >= interval:
                news[req] = None

    def _end_grammars(self, ended: list[tuple[Request, str]]) -> None:
        """Finish the requests whose grammar the step's ids completed (preempted ones too)."""
        for req, reason in ended:
            if not req.is_finished:
                self.finish(req, reason)

    def _check_token_stop(self, req: Request, token_id: int) -> None:
        """Finish req on a stop id (past min_tokens) just sampled, or at its length limit."""
        params = req.params
        past_min = req.num_output_tokens >= params.min_tokens
        if past_min and not params.ignore_eos and token_id in self.eos_set:
            self.finish(req, "stop")
            req.hide_last_token = not params.include_stop_str_in_output
        elif past_min and token_id in params.stop_token_ids:
            self.finish(req, "stop", token_id)
            req.hide_last_token = not params.include_stop_str_in_output
        elif req.num_tokens >= req.max_num_tokens:
            self.finish(req, "length")

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        self.scheduler.finish(req, reason, stop_reason)
        self.news[req] = None  # its last output
        siblings = self.requests.get(req.request_id, [])
        if all(r.is_finished for r in siblings):
            self.requests.pop(req.request_id, None)
