"""Quiet runs (engine.quiet_run) book a steady batch's ids as numpy rows and append them
later: final-only requests must get exactly what the same requests streamed get (they
take the ordinary path every step), on a workload that ends runs in every way one can
end (a length limit, a stop id among the ids, an admission, an abort, preemption, a
full array), with the prefix cache on."""

from __future__ import annotations

import dataclasses

from engine import LLM, SamplingParams, quiet_run
from engine.quiet_run import QuietRun
from tests.engine.test_steady_state import drive, trace_batches


def plans(stop_id: int | None) -> list[tuple[list[int], SamplingParams]]:
    stop_ids = [] if stop_id is None else [stop_id]
    return [
        ([5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True)),
        ([9] * 11, SamplingParams(max_tokens=23, ignore_eos=True)),
        ([3, 1, 4, 1, 5], SamplingParams(max_tokens=30, temperature=0.9, seed=7)),
        ([2, 7, 1, 8], SamplingParams(max_tokens=25, temperature=0.0)),  # may stop at EOS
        ([8, 8], SamplingParams(max_tokens=60, ignore_eos=True, n=2, temperature=1.0, seed=3)),
        ([4] * 6, SamplingParams(max_tokens=12, ignore_eos=True, min_tokens=5)),  # no runs
        ([6, 5, 4, 3, 2, 1], SamplingParams(max_tokens=50, ignore_eos=True)),  # aborted
        ([1] * 3, SamplingParams(max_tokens=70, ignore_eos=True, stop_token_ids=stop_ids)),
        ([7, 7, 7], SamplingParams(max_tokens=45, ignore_eos=True)),
    ]


def run_workload(model_dir: str, final_only: bool, stop_id: int | None) -> tuple[list, dict]:
    """(every batch as scheduled, every choice's tokens and finish)."""
    llm = LLM(
        model_dir,
        device="cpu",
        block_size=4,
        max_model_len=96,
        num_kv_blocks=30,  # tight: long requests preempt the newest
        max_num_seqs=5,
        max_num_batched_tokens=32,
        enable_prefix_caching=True,
    )
    engine = llm.engine
    # Without registered hashes: a run registers the blocks it filled when it ends,
    # the ordinary path at the next block a request opens.
    batches = trace_batches(engine, hashes=False)
    todo = [(prompt, dataclasses.replace(p, final_only=final_only)) for prompt, p in plans(stop_id)]
    results = drive(engine, todo, every=11, abort=(95, "r66"))
    assert engine.run is None  # everything booked was appended
    return batches, results


def test_quiet_runs_give_what_the_ordinary_path_gives(tiny_gpt2_dir, monkeypatch):
    # A stop id the stop-id request produces in this workload, first after 20 tokens (by
    # then the batch has settled into its steady state).
    _, first = run_workload(tiny_gpt2_dir, False, None)
    ids = first[("r77", 0)][0]
    stop_id = next(t for i, t in enumerate(ids) if i >= 20 and t not in ids[:i])

    monkeypatch.setattr(quiet_run, "ROWS", 5)  # runs fill their array and go on
    counts = {"booked": 0, "stop": 0, "appends": 0}
    read, append = QuietRun.read, QuietRun.append

    def counted_read(self, ids):
        booked = read(self, ids)
        counts["booked" if booked else "stop"] += 1
        return booked

    def counted_append(self):
        counts["appends"] += self.rows > 0
        append(self)

    monkeypatch.setattr(QuietRun, "read", counted_read)
    monkeypatch.setattr(QuietRun, "append", counted_append)
    quiet, quiet_out = run_workload(tiny_gpt2_dir, True, stop_id)
    booked = counts["booked"]
    streamed, streamed_out = run_workload(tiny_gpt2_dir, False, stop_id)
    assert counts["booked"] == booked  # streamed requests take no runs

    assert quiet == streamed
    assert ("r66", 0) not in quiet_out  # aborted: a final-only request reports nothing
    assert streamed_out.pop(("r66", 0))[1] is None  # ... a streamed one, what it had
    assert quiet_out == streamed_out
    assert booked >= 60, counts  # most decode steps were booked, not appended
    assert counts["stop"] >= 1 and counts["appends"] > booked // 5, counts
    assert any(batch[5] for batch in quiet)  # the workload preempted
    assert quiet_out[("r77", 0)][1] == "stop"  # the stop id was found in a booked row
    lengths = {key: len(ids) for key, (ids, _) in quiet_out.items()}
    assert lengths[("r0", 0)] == 40 and lengths[("r44", 1)] == 60
