"""RequestStream: one client request's outputs, decoded to text on the event loop.

The engine is always asked for token ids only (SamplingParams.detokenize=False,
no stop strings): text is decoded here, in every layout, and stop strings are
matched here too, as vLLM v1's output processor does. At saturation the
engine's host side is the limit and the API side has cores to spare; and
ids-only streams travel between the engine and the API side as TokenDeltas
columns instead of objects.

A stop string that completes inside a delta cuts it after the token that
completed it: ids, logprobs and counts past that token are dropped, the choice
finishes with finish_reason "stop", and its later outputs are ignored. Once
every choice of an engine request is over, the stream asks for the request to
be aborted so the engine stops generating it (with n > 1 a choice that stopped
early keeps running in the engine until its siblings end: the engine aborts
whole requests).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from engine.detokenizer import IncrementalDetokenizer
from engine.request import RequestMetrics, RequestOutput
from server.errors import APIError

Choice = tuple[str, int]  # (engine request id, choice index)


def coalesce(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """Merge the deltas of each choice into one (order of first appearance)."""
    groups: dict[Choice, list[RequestOutput]] = {}
    for out in outputs:
        groups.setdefault((out.request_id, out.index), []).append(out)
    merged = []
    for group in groups.values():
        if len(group) == 1:
            merged.append(group[0])
            continue
        logprobs = None
        if any(out.new_logprobs is not None for out in group):
            logprobs = [lp for out in group for lp in out.new_logprobs or []]
        merged.append(
            dataclasses.replace(
                group[-1],
                new_token_ids=[t for out in group for t in out.new_token_ids],
                new_text="".join(out.new_text for out in group),
                new_logprobs=logprobs,
                # Only a choice's first output carries its prompt's logprobs (when asked).
                prompt_logprobs=group[0].prompt_logprobs,
            )
        )
    return merged


class RequestStream:
    """The outputs of one client request: one engine request per prompt, n choices each.

    Iterating yields, per delivery, the list of RequestOutputs (with text) for this
    client request; an APIError ends it when the engine fails or shuts down.
    """

    def __init__(
        self,
        request_ids: list[str],
        n: int,
        decoders: dict[Choice, IncrementalDetokenizer],
        has_stop_strings: bool,
        on_abort: Callable[[RequestStream], None],
    ) -> None:
        self.request_ids = request_ids
        self.n = n
        self._decoders = decoders
        self._has_stop_strings = has_stop_strings
        self._on_abort = on_abort  # the client went away: stop the engine requests
        self._queue: asyncio.Queue[list[RequestOutput] | APIError] = asyncio.Queue()
        self.unfinished = {(rid, i) for rid in request_ids for i in range(n)}
        self.last_token_time: dict[Choice, float] = {}  # for inter-token latency
        # Each choice's latest output from the engine, which its next TokenDeltas entry follows.
        self.last_output: dict[Choice, RequestOutput] = {}
        self._first_metrics: dict[Choice, RequestMetrics] = {}
        self._stopped: set[Choice] = set()  # ended here by a stop string
        self._num_over: dict[str, int] = {}  # engine request id -> choices over, seen here
        # Engine requests that are over here while the engine may still run them.
        self.to_abort: list[str] = []
        self.finished = False
        self._error: APIError | None = None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> list[RequestOutput]:
        if self._error is not None:
            raise self._error
        if self.finished and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, APIError):
            raise item
        # Under load the loop falls behind the engine: hand over all that is queued,
        # merged per choice, so the client gets fewer, larger chunks, not a backlog.
        while not self._queue.empty():
            more = self._queue.get_nowait()
            if isinstance(more, APIError):
                self._error = more  # after the outputs that came before it
                break
            item = item + more
        return coalesce(item)

    def abort(self) -> None:
        """Stop generating (the client went away); idempotent, a no-op once finished."""
        if not self.finished:
            self.finished = True
            self._on_abort(self)

    def decode(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The engine's outputs of one step (ids only), with their text; in step order."""
        kept = []
        for out in outputs:
            key = out.request_id, out.index
            if key in self._stopped:
                continue  # tokens the engine made after the stop string
            if out.metrics is not None and key not in self._first_metrics:
                self._first_metrics[key] = out.metrics
            decoder = self._decoders[key]
            ids = out.new_token_ids
            shown = ids[:-1] if out.hide_last_token else ids  # a stop token has no text
            if self._has_stop_strings:
                out = self._match_stop(decoder, out, shown)
            else:
                decoder.update(shown)
            out.new_text = decoder.get_delta(out.finished)
            if out.finished:  # all n over, one by a stop string: the engine may still run it
                rid = out.request_id
                over = self._num_over[rid] = self._num_over.get(rid, 0) + 1
                if over == self.n and any((rid, i) in self._stopped for i in range(self.n)):
                    self.to_abort.append(rid)
            kept.append(out)
        return kept

    def _match_stop(
        self, decoder: IncrementalDetokenizer, out: RequestOutput, shown: list[int]
    ) -> RequestOutput:
        """Decode token by token (the ids with text, `shown`): a stop string ends the
        choice at the token that completes it."""
        ids = out.new_token_ids
        stop, cut = None, 0
        while stop is None and cut < len(shown):
            stop = decoder.update(shown[cut : cut + 1])
            cut += 1
        if stop is None:
            return out
        key = out.request_id, out.index
        self._stopped.add(key)
        metrics = out.metrics
        if metrics is None:  # the engine has not finished it: the end is now
            metrics = dataclasses.replace(self._first_metrics[key], finished_time=None)
        return dataclasses.replace(
            out,
            new_token_ids=ids[:cut],
            new_logprobs=None if out.new_logprobs is None else out.new_logprobs[:cut],
            finished=True,
            finish_reason="stop",
            stop_reason=stop,
            num_output_tokens=out.num_output_tokens - (len(ids) - cut),
            metrics=metrics,
        )

    def push(self, item: list[RequestOutput] | APIError) -> None:
        """Decoded outputs, or the error that ends the stream."""
        if isinstance(item, APIError):
            self.finished = True
            self.unfinished.clear()
        else:
            for out in item:
                if out.finished:
                    self.unfinished.discard((out.request_id, out.index))
            self.finished = not self.unfinished
        self._queue.put_nowait(item)
