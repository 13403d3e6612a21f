"""A request's state inside the engine, and what the engine hands back."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # the API processes import this module, and never need torch
    import torch

    from engine.images import PromptImages
    from engine.input_batch import InputBatch


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
    # On a choice's first output, when asked for (params.prompt_logprobs): one entry per
    # prompt token, the first None. Last, with a default: outputs are built positionally.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Its last id is the stop token that ended it, whose text the answer leaves out.
    hide_last_token: bool = False
    # With params.pooling, on its last output: the prompt's embedding (engine/pooling.py).
    embedding: list[float] | None = None


@dataclass
class TokenDeltas:
    """Outputs that are token ids and nothing else, in columns: the news of choices
    that stream ids without text or logprobs, between their first output and their last.

    Such a choice's RequestOutput differs from its previous one only in its new ids
    and count, so the engine process reports it as list entries, not an object whose
    fields are pickled and rebuilt. The API process rebuilds each output from the
    choice's previous one (`follow`)."""

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
    """One sequence being generated (a request with n > 1 becomes n of these).

    While it runs it owns a row of the InputBatch (engine/input_batch.py), which
    holds its token ids and counts: the properties below read them from there,
    and `detach` brings them back when it leaves (finished or preempted). A
    streamed request's generated ids are news every step, so the engine also
    appends them to its own list as they are read (`streamed`): its outputs are
    cut from that list. A plain stream's (ids only: no text, logprobs or stop
    strings) are not: its outputs after the first are cut from the batch's columns
    for all such rows at once (engine/outputs.py, `take_plain`)."""

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
        self.status = RequestStatus.WAITING
        # Generated ids, off the batch; a streamed request's also while it runs.
        self.output_ids: list[int] = []
        # Looked at one by one as its ids are read: streamed (not plain), or stop
        # strings to match.
        self.streamed = (not params.final_only and not params.plain) or bool(params.stop)
        self._num_computed = 0  # off the batch (the prefix cache's hits before admission)
        self._num_inflight = 0  # off the batch: ids sampled on the device, not read yet
        self.batch: InputBatch | None = None  # while running
        self.slot: int = -1  # its row of the batch and of the block table while running
        # Its LoRA adapter's index (-1: the base model), set by the engine; the adapter's
        # KV differs from the base model's, so its blocks hash from a root of their own.
        self.lora_index = -1
        self.hash_root: bytes | None = None
        self.num_cached_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of its full blocks, as computed
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # Ended by a stop token (EOS or stop_token_ids) whose text the answer leaves out.
        self.hide_last_token = False
        self.metrics = RequestMetrics(arrival_time or time.time())
        # Choice i > 0 waits until choice 0 has prefilled the prompt, so it
        # finds the prompt's full blocks in the prefix cache.
        self.wait_for = wait_for
        self.generator: torch.Generator | None = None
        # Its grammar's matcher (engine.structured.grammars.GrammarState), if it has one.
        self.structured = None
        self.detokenizer = None  # set by the engine: engine.detokenizer.IncrementalDetokenizer
        self.pending_logprobs: list[TokenLogprob] = []
        # Entry i: prompt token i's logprob given those before it (the first has none),
        # filled chunk by chunk as its prefill runs; None unless asked for.
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            None if params.prompt_logprobs is None else [None]
        )
        self.num_detokenized_tokens = 0
        self.embedding: list[float] | None = None  # params.pooling: engine/pooling.py
        self.images: PromptImages | None = None  # its prompt's image features (engine/images.py)
        self._num_emitted = 0  # off the batch: output ids already in outputs

    @property
    def scores_prompt(self) -> bool:
        """Its prompt logprobs are asked for and not all computed: its prefill needs
        logits at every prompt position (so no prefix-cache hits)."""
        scores = self.prompt_logprobs
        return scores is not None and len(scores) < len(self.prompt_token_ids)

    def add_prompt_logprobs(self, first: int, entries: list[TokenLogprob]) -> None:
        """Entries for prompt tokens first, first + 1, ...: a prefill chunk's. A chunk
        computed again (after a preemption) brings nothing new."""
        scores = self.prompt_logprobs
        assert scores is not None and first <= len(scores)
        scores.extend(entries[len(scores) - first :])

    def detach(
        self, output_ids: list[int], num_computed: int, num_inflight: int, num_emitted: int
    ) -> None:
        self.output_ids = output_ids
        self._num_emitted = num_emitted
        self._num_computed = num_computed
        self._num_inflight = num_inflight
        self.batch, self.slot = None, -1

    def receive_departed(self, token_id: int) -> None:
        """An id sampled before it was preempted, read since."""
        self.output_ids.append(token_id)
        self._num_inflight -= 1

    @property
    def num_computed_tokens(self) -> int:
        if self.batch is not None:
            return self.batch.num_computed.item(self.slot)
        return self._num_computed

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        if self.batch is not None:
            self.batch.set_computed(self.slot, value)
        else:
            self._num_computed = value

    @property
    def num_inflight(self) -> int:
        """Ids sampled on the device that the host has not read yet."""
        if self.batch is not None:
            return self.batch.num_tokens.item(self.slot) - self.batch.num_known.item(self.slot)
        return self._num_inflight

    @property
    def num_emitted_tokens(self) -> int:
        """Output ids already in outputs."""
        if self.batch is not None:
            return self.batch.emit_at.item(self.slot) - len(self.prompt_token_ids)
        return self._num_emitted

    @num_emitted_tokens.setter
    def num_emitted_tokens(self, value: int) -> None:
        if self.batch is not None:
            self.batch.emit_at[self.slot] = len(self.prompt_token_ids) + value
        else:
            self._num_emitted = value

    @property
    def num_tokens(self) -> int:
        """Tokens whose ids the host knows, prompt included."""
        if self.batch is not None:
            return self.batch.num_known.item(self.slot)
        return len(self.prompt_token_ids) + len(self.output_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        """Output tokens so far, counting those still on the device."""
        return self.num_output_tokens + self.num_inflight

    def output_ids_from(self, start: int) -> list[int]:
        if self.batch is not None and not self.streamed:
            return self.batch.token_slice(self.slot, len(self.prompt_token_ids) + start)
        return self.output_ids[start:]

    @property
    def output_token_ids(self) -> list[int]:
        return self.output_ids_from(0)

    def token_slice(self, start: int, end: int | None = None) -> list[int]:
        """Known ids at positions [start, end), prompt included (end None: all known)."""
        if self.batch is not None:
            return self.batch.token_slice(self.slot, start, end)
        return (self.prompt_token_ids + self.output_ids)[start:end]

    @property
    def all_token_ids(self) -> list[int]:
        return self.token_slice(0)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id}#{self.index}, {self.status.value}, computed={self.num_computed_tokens}/"
            f"{self.num_tokens}, blocks={len(self.block_ids)})"
        )
