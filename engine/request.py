"""A request's state inside the engine, and what the engine hands back."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]  # the `logprobs` most likely (token_id, logprob), best first


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """One step's news for one choice of a request: deltas, not totals."""

    request_id: str
    index: int  # which of the request's n choices
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    stop_reason: int | str | None  # the stop token id or stop string that ended it
    num_prompt_tokens: int
    num_output_tokens: int  # cumulative
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    # On a choice's outputs up to its first token, and on its last: what the latency
    # metrics read (TTFT, queue time, E2E). None in between, so that the engine
    # process's reports do not pickle it again every step (half of their bytes).
    metrics: RequestMetrics | None


@dataclass
class TokenDeltas:
    """Outputs that are token ids and nothing else, in columns: the news of choices
    that stream ids without text or logprobs, between their first output and their last.

    Such a choice's RequestOutput differs from its previous one only in its new ids
    and count, so the engine process reports it as list entries, not an object whose
    fields are pickled and rebuilt. The API process rebuilds each output from the
    choice's previous one (`follow`).
    """

    request_ids: list[str] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # each entry's share of token_ids
    token_ids: list[int] = field(default_factory=list)  # every entry's new ids, in order

    def __len__(self) -> int:
        return len(self.request_ids)

    def entries(self) -> Iterator[tuple[str, int, list[int]]]:
        """(request id, choice, new ids) of each entry."""
        start = 0
        ids = self.token_ids
        for request_id, index, n in zip(self.request_ids, self.indices, self.num_tokens):
            yield request_id, index, ids[start : start + n]
            start += n


def follow(prev: RequestOutput, token_ids: list[int]) -> RequestOutput:
    """The output that follows prev with token_ids (a TokenDeltas entry of its choice)."""
    return RequestOutput(
        prev.request_id,
        prev.index,
        token_ids,
        "",
        None,
        False,
        None,
        None,
        prev.num_prompt_tokens,
        prev.num_output_tokens + len(token_ids),
        prev.num_cached_tokens,
        None,
    )


class Request:
    """One sequence being generated (a request with n > 1 becomes n of these)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        index: int = 0,
        arrival_time: float | None = None,
        wait_for: Request | None = None,
    ) -> None:
        self.request_id = request_id  # the client's id, shared by the n choices
        self.index = index
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        # Tokens it may reach, prompt included: the scheduler caps it at max_model_len.
        self.max_num_tokens = (
            len(prompt_token_ids) + params.max_tokens if params.max_tokens is not None else 1 << 62
        )
        # Sampled ids that end it (EOS unless ignored, stop_token_ids): set by the engine.
        self.stop_ids: frozenset[int] = frozenset()
        # Generated ids; all_token_ids is what the model has seen or will see.
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.status = RequestStatus.WAITING
        # Tokens whose KV is computed or scheduled: the scheduler advances it when it
        # schedules them, before the step runs.
        self.num_computed_tokens = 0
        # Tokens sampled on the device whose ids the host has not read yet (0 or 1,
        # briefly 2): the next step takes them from the device.
        self.num_inflight = 0
        self.num_cached_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of its full blocks, as computed
        self.slot: int = -1  # row of the persistent block table while running
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.metrics = RequestMetrics(arrival_time or time.time())
        # Choice i > 0 waits until choice 0 has prefilled the prompt, so it
        # finds the prompt's full blocks in the prefix cache.
        self.wait_for = wait_for
        self.generator: torch.Generator | None = None
        # Its grammar's matcher (engine.structured.grammars.GrammarState), if it has one.
        self.structured = None
        self.detokenizer = None  # set by the engine: engine.detokenizer.IncrementalDetokenizer
        self.pending_logprobs: list[TokenLogprob] = []
        self.num_detokenized_tokens = 0
        self.num_emitted_tokens = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        """Output tokens so far, counting those still on the device."""
        return len(self.output_token_ids) + self.num_inflight

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id}#{self.index}, {self.status.value}, computed={self.num_computed_tokens}/"
            f"{self.num_tokens}, blocks={len(self.block_ids)})"
        )


def out_of_vocab(token_ids: list[int], vocab_size: int) -> int | None:
    """The first id outside [0, vocab_size), or None; min/max first, since a scan in
    Python costs ~40 ns an id, paid on every request's prompt."""
    if not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size):
        return None
    return next(t for t in token_ids if not 0 <= t < vocab_size)
