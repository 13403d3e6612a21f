"""The steady state's shortcuts (the scheduler repeating the last batch one position on,
the runner rewriting only what moved) must change nothing: the same batches, the
same blocks, the same tokens as the general path, on a workload that leaves the
steady state in every way it can (admissions, stops, length limits, aborts,
preemption, new blocks)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.scheduler import Scheduler
from tests.engine.test_async_steps import count_rows


def trace_batches(engine, hashes: bool) -> list[tuple]:
    """Wrap the scheduler to record every batch it hands out as plain values (with
    hashes: how many full blocks each request has registered, too)."""
    batches: list[tuple] = []
    schedule = engine.scheduler.schedule

    def traced():
        out = schedule()
        batch = (
            [(r.request_id, r.index) for r in out.requests],
            [int(s) for s in out.starts],
            list(out.num_new_tokens),
            list(out.chunked),
            list(out.grown),
            [r.request_id for r in out.preempted],
            [list(r.block_ids) for r in out.requests],
        )
        if hashes:
            batch += ([len(r.block_hashes) for r in out.requests],)
        batches.append(batch)
        return out

    engine.scheduler.schedule = traced
    return batches


def drive(engine, plans: list, every: int, abort: tuple[int, str]) -> dict:
    """Add the next plan as request f"r{step}" every `every` steps and abort one at a
    step; step until done. Returns each choice's [tokens, finish reason]."""
    plans = list(plans)
    abort_step, abort_id = abort
    results: dict = {}
    step = 0
    while plans or engine.has_unfinished_requests():
        if plans and step % every == 0:
            prompt, params = plans.pop(0)
            engine.add_request(f"r{step}", prompt, params)
        if step == abort_step:
            engine.abort_request(abort_id)
        for out in engine.step():
            got = results.setdefault((out.request_id, out.index), [[], None])
            got[0] += out.new_token_ids
            if out.finished:
                got[1] = out.finish_reason
        step += 1
        assert step < 3000
    return results


def run_workload(model_dir: str, steady: bool, monkeypatch) -> tuple[list, dict, int, int]:
    """(every batch as scheduled, every choice's tokens and finish, steady batches,
    those of them right after a step that prefilled)."""
    llm = LLM(
        model_dir,
        device="cpu",
        block_size=4,
        max_model_len=96,
        num_kv_blocks=28,  # tight: long requests preempt the newest
        max_num_seqs=6,
        max_num_batched_tokens=32,
        enable_prefix_caching=True,
    )
    engine = llm.engine
    advance = Scheduler._advance
    taken = after_prefill = 0

    def counted(self, *args):
        nonlocal taken, after_prefill
        out = advance(self, *args) if steady else None
        taken += out is not None
        after_prefill += out is not None and max(batches[-1][2]) > 1
        return out

    monkeypatch.setattr(Scheduler, "_advance", counted)
    batches = trace_batches(engine, hashes=True)
    plans = [
        ([5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True)),
        ([9] * 11, SamplingParams(max_tokens=23, ignore_eos=True)),
        ([3, 1, 4, 1, 5], SamplingParams(max_tokens=30, temperature=0.9, seed=7)),
        ([2, 7, 1, 8], SamplingParams(max_tokens=25, temperature=0.0)),  # may stop at EOS
        ([8, 8], SamplingParams(max_tokens=60, ignore_eos=True, n=2, temperature=1.0, seed=3)),
        ([4] * 6, SamplingParams(max_tokens=17, ignore_eos=True, stop_token_ids=[11, 12])),
        ([6, 5, 4, 3, 2, 1], SamplingParams(max_tokens=50, ignore_eos=True, logprobs=2)),
        ([1] * 3, SamplingParams(max_tokens=70, ignore_eos=True)),
    ]
    results = drive(engine, plans, every=9, abort=(90, "r63"))
    return batches, results, taken, after_prefill


def test_steady_batches_equal_the_general_path(tiny_gpt2_dir, monkeypatch):
    fast, fast_out, taken, after_prefill = run_workload(tiny_gpt2_dir, True, monkeypatch)
    slow, slow_out, none_taken, _ = run_workload(tiny_gpt2_dir, False, monkeypatch)
    assert none_taken == 0
    assert taken >= 40, taken  # the shortcut ran, often
    assert after_prefill >= 3, after_prefill  # ... right after admitting prompts, too
    assert any(batch[4] for batch in fast[1:])  # ... and some of its steps opened blocks
    assert any(batch[5] for batch in slow)  # the workload preempted
    assert fast == slow
    assert fast_out == slow_out
    assert fast_out[("r63", 0)][1] is None  # aborted: no final output


@pytest.mark.parametrize("max_tokens", [3, 4, 5])
def test_a_limit_inside_the_steady_state_costs_no_extra_row(tiny_gpt2_dir, max_tokens):
    # Ends land right before, on and after a block boundary (block_size 4).
    llm = LLM(tiny_gpt2_dir, device="cpu", block_size=4)
    engine = llm.engine
    for i in range(3):
        engine.add_request(
            f"r{i}",
            [5, 6, 7, 8][: i + 2],
            SamplingParams(max_tokens=max_tokens + 4 * i, ignore_eos=True),
        )
    rows = count_rows(engine)
    while engine.has_unfinished_requests():
        engine.step()
    assert rows == {f"r{i}": max_tokens + 4 * i for i in range(3)}
