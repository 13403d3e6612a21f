"""Deltas queued while the event loop was busy are merged per choice."""

from __future__ import annotations

from engine.request import RequestMetrics, RequestOutput, TokenLogprob
from server.async_engine import coalesce


def out(
    rid: str, index: int, ids: list[int], text: str, finished=False, logprobs=None
) -> RequestOutput:
    return RequestOutput(
        request_id=rid,
        index=index,
        new_token_ids=ids,
        new_text=text,
        new_logprobs=logprobs,
        finished=finished,
        finish_reason="length" if finished else None,
        stop_reason=None,
        num_prompt_tokens=3,
        num_output_tokens=len(ids),
        num_cached_tokens=0,
        metrics=RequestMetrics(0.0),
    )


def test_coalesce_merges_per_choice_and_keeps_the_last_state():
    lp = [TokenLogprob(1, -0.5, 1, [])]
    merged = coalesce(
        [
            out("a", 0, [1], "He", logprobs=lp),
            out("a", 1, [7], "X"),
            out("a", 0, [2], "llo", logprobs=lp),
            out("a", 0, [3], "!", finished=True, logprobs=lp),
        ]
    )
    assert [(m.request_id, m.index) for m in merged] == [("a", 0), ("a", 1)]
    first = merged[0]
    assert first.new_token_ids == [1, 2, 3] and first.new_text == "Hello!"
    assert first.finished and first.finish_reason == "length"
    assert len(first.new_logprobs) == 3
    assert merged[1].new_text == "X" and merged[1].new_logprobs is None


def test_coalesce_leaves_single_outputs_alone():
    single = [out("a", 0, [1], "x"), out("b", 0, [2], "y")]
    assert coalesce(single) == single
