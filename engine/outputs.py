"""RequestOutputs from a request's news: the ids since its last output, their text
and logprobs. The engine notes which requests have news as it reads ids; this
turns them into outputs when the consumer asks (Engine.take_outputs). The plain
streams' news after their first output is not noted: every running plain stream
has some at almost every step, and it is cut from the batch's columns (take_plain)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from engine.request import Request, RequestOutput, RequestStatus, TokenDeltas, TokenLogprob

if TYPE_CHECKING:
    from engine.input_batch import InputBatch


def detokenize(req: Request) -> str | None:
    """Decode what req gained since last time; the stop string it reached, if it is
    still running (a finished request's reason is corrected in place: a token-level
    stop came first, but the text stops earlier)."""
    new_ids = req.output_ids_from(req.num_detokenized_tokens)
    if req.hide_last_token:  # a stop token's text is not the answer's (as in vLLM)
        new_ids = new_ids[:-1]
    if not new_ids:
        return None
    req.num_detokenized_tokens += len(new_ids)
    params = req.params
    if params.final_only and not params.stop:
        req.detokenizer.decode_all(new_ids)  # seen once, when finished: one call
        return None
    stop_string = req.detokenizer.update(new_ids)
    if stop_string is not None and req.is_finished:
        req.finish_reason, req.stop_reason = "stop", stop_string
        return None
    return stop_string


def take_outputs(news: dict[Request, None], deltas: TokenDeltas | None) -> list[RequestOutput]:
    """One RequestOutput per request in news; with deltas, a plain stream's between
    its first output and its last goes there as ids instead."""
    finished = RequestStatus.FINISHED
    outputs = []
    plain = deltas is not None
    for req in news:
        emitted = req.num_emitted_tokens
        if plain and emitted and req.params.plain and req.status is not finished:
            new_ids = req.output_ids_from(emitted)
            req.num_emitted_tokens = emitted + len(new_ids)
            deltas.request_ids.append(req.request_id)
            deltas.indices.append(req.index)
            deltas.num_tokens.append(len(new_ids))
            deltas.token_ids += new_ids
        else:
            out = build_output(req)
            if out is not None:
                outputs.append(out)
    return outputs


def build_output(req: Request) -> RequestOutput | None:
    """The news since req's last output (None: a final-only request still running).
    A running request's stop strings were matched as its ids were read."""
    params = req.params
    if params.detokenize:
        detokenize(req)
    finished = req.status is RequestStatus.FINISHED
    if params.final_only and not finished:
        return None
    emitted = req.num_emitted_tokens
    new_ids = req.output_ids_from(emitted)
    req.num_emitted_tokens = num_output = emitted + len(new_ids)
    logprobs: list[TokenLogprob] | None = None
    if params.logprobs is not None:
        logprobs, req.pending_logprobs = req.pending_logprobs, []
    return RequestOutput(
        req.request_id,
        req.index,
        new_ids,
        req.detokenizer.get_delta(finished) if params.detokenize else "",
        logprobs,
        finished,
        req.finish_reason,
        req.stop_reason,
        len(req.prompt_token_ids),
        num_output,
        req.num_cached_tokens,
        req.metrics if emitted == 0 or finished else None,
        req.prompt_logprobs if emitted == 0 else None,
        req.hide_last_token and bool(new_ids),
        req.embedding if finished else None,
    )


def take_plain(batch: InputBatch, deltas: TokenDeltas | None, interval: int) -> list[RequestOutput]:
    """The news of the running plain streams past their first output (which news
    carried): at least `interval` ids each. Into deltas, a few array operations for
    all of them; without deltas, one RequestOutput each."""
    slots = batch.slots[batch.plain[batch.slots]]  # in batch order
    start = batch.emit_at[slots]
    count = batch.num_known[slots] - start
    keep = count >= interval
    if not keep.all():
        slots, start, count = slots[keep], start[keep], count[keep]
    if not len(slots):
        return []
    if deltas is None:
        return [build_output(batch.requests[slot]) for slot in slots.tolist()]
    deltas.request_ids += batch.request_ids[slots].tolist()
    deltas.indices += batch.choice[slots].tolist()
    deltas.num_tokens += count.tolist()
    if not np.any(count > 1):  # one id each: one gather
        deltas.token_ids += batch.token_flat[batch.row_start[slots] + start].tolist()
    else:
        for slot, first, n in zip(slots.tolist(), start.tolist(), count.tolist()):
            deltas.token_ids += batch.token_ids[slot, first : first + n].tolist()
    batch.emit_at[slots] += count
    return []
