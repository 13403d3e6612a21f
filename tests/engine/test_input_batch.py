"""InputBatch: per-slot columns for running requests; the engine's one decode path over it."""

from __future__ import annotations

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.input_batch import InputBatch
from engine.request import Request, RequestStatus
from tests.engine.test_async_steps import count_rows

EOS = 0


def request(name: str, prompt: list[int], **params) -> Request:
    req = Request(name, prompt, SamplingParams(**params))
    req.stop_ids = frozenset(([] if req.params.ignore_eos else [EOS]) + req.params.stop_token_ids)
    req.max_num_tokens = min(req.max_num_tokens, 64)
    return req


def sample(batch: InputBatch, reqs: list[Request], ids: list[int]):
    """Launch one token for each of reqs, then read `ids` back as their values."""
    slots = np.array([r.slot for r in reqs], dtype=np.int64)
    return batch.read(slots, batch.launched(slots), np.array(ids, dtype=np.int64))


def test_requests_join_and_leave_mid_run_and_keep_their_rows():
    batch = InputBatch(4, 64, 64)
    a, b, c = request("a", [1, 2, 3]), request("b", [4, 5]), request("c", [6])
    for r in (a, b, c):
        batch.add(r)
    assert [r.slot for r in (a, b, c)] == [0, 1, 2]
    assert batch.slots.tolist() == [0, 1, 2] and batch.running == [a, b, c]
    sample(batch, [a, b, c], [10, 11, 12])
    batch.remove(b)  # finished or preempted: its row goes, the others stay put
    assert b.batch is None and b.output_token_ids == [11] and b.num_tokens == 3
    d = request("d", [7, 8, 9, 10])
    assert batch.add(d) == 1  # b's slot, reused
    assert batch.slots.tolist() == [0, 2, 1] and batch.running == [a, c, d]
    sample(batch, [a, c, d], [20, 21, 22])
    assert a.all_token_ids == [1, 2, 3, 10, 20]
    assert c.output_token_ids == [12, 21] and d.output_token_ids == [22]
    assert batch.num_known[[0, 2, 1]].tolist() == [5, 3, 5]


def test_ids_in_flight_are_counted_and_read_in_order():
    batch = InputBatch(2, 64, 64)
    a = request("a", [1, 2])
    batch.add(a)
    slot = np.array([a.slot])
    first = batch.launched(slot)
    second = batch.launched(slot)  # the host runs a step ahead: two on the device
    assert a.num_inflight == 2 and a.num_tokens == 2 and a.num_generated_tokens == 2
    batch.read(slot, first, np.array([5]))
    assert a.num_inflight == 1 and a.output_token_ids == [5]
    batch.read(slot, second, np.array([6]))
    assert a.num_inflight == 0 and a.output_token_ids == [5, 6]


def test_stops_are_found_for_the_whole_batch_in_one_read():
    batch = InputBatch(4, 64, 64)
    plain = request("plain", [1])
    eos = request("eos", [1])
    ignores = request("ignores", [1], ignore_eos=True)
    held = request("held", [1], min_tokens=2, stop_token_ids=[9])
    short = request("short", [1, 2], max_tokens=1)
    reqs = [plain, eos, ignores, held]
    for r in reqs:
        batch.add(r)
    got = sample(batch, reqs, [3, EOS, EOS, 9])
    assert got.done.tolist() == [False, True, False, False]  # held: min_tokens not reached
    assert got.first.all()
    got = sample(batch, [held], [9])
    assert got.done.tolist() == [True] and got.first is None
    batch.remove(eos)
    batch.add(short)
    assert sample(batch, [short], [3]).done.tolist() == [True]  # its length limit


def test_ids_of_a_request_that_left_go_to_it_or_nowhere():
    batch = InputBatch(2, 64, 64)
    a, b = request("a", [1, 2]), request("b", [3])
    batch.add(a)
    batch.add(b)
    slots = np.array([a.slot, b.slot])
    mark = batch.launched(slots)
    a.status = RequestStatus.FINISHED  # aborted with its id on the device
    batch.remove(a)
    batch.remove(b)  # preempted with its id on the device
    assert b.num_inflight == 1
    c = request("c", [4])
    batch.add(c)  # a's slot: the read must not give c a's id
    got = batch.read(slots, mark, np.array([7, 8]))
    assert got.slots.tolist() == [] and c.num_tokens == 1 and c.output_token_ids == []
    assert b.output_token_ids == [8] and b.num_inflight == 0
    assert got.departed == [(b, 8)]  # the engine checks it for a stop: b may be done
    assert a.output_token_ids == []


PLANS = [
    ([5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0)),
    ([9] * 11, SamplingParams(max_tokens=23, ignore_eos=True, temperature=0.0)),
    ([3, 1, 4, 1, 5], SamplingParams(max_tokens=30, temperature=0.9, seed=7)),
    ([2, 7, 1, 8], SamplingParams(max_tokens=25, temperature=0.0)),  # may stop at EOS
    ([8, 8], SamplingParams(max_tokens=60, ignore_eos=True, n=2, temperature=1.0, seed=3)),
    ([4] * 6, SamplingParams(max_tokens=17, temperature=0.0, stop_token_ids=[11, 12])),
    ([6, 5, 4, 3, 2, 1], SamplingParams(max_tokens=50, ignore_eos=True, logprobs=2, seed=5)),
    ([1] * 3, SamplingParams(max_tokens=70, ignore_eos=True, presence_penalty=0.5, seed=1)),
]


def drive(engine, plans: list, every: int, abort: tuple[int, str] | None) -> dict:
    """Add the next plan as request f"r{i}" every `every` steps and abort one at a
    step; step until done. Returns each choice's [tokens, finish reason]."""
    plans = list(enumerate(plans))
    results: dict = {}
    step = 0
    while plans or engine.has_unfinished_requests():
        if plans and step % every == 0:
            i, (prompt, params) = plans.pop(0)
            engine.add_request(f"r{i}", prompt, params)
        if abort is not None and step == abort[0]:
            engine.abort_request(abort[1])
        for out in engine.step():
            got = results.setdefault((out.request_id, out.index), [[], None])
            got[0] += out.new_token_ids
            if out.finished:
                got[1] = out.finish_reason
        step += 1
        assert step < 3000
    return results


def test_a_churning_batch_gives_each_request_its_tokens_alone(tiny_gpt2_dir):
    """Admissions, stops, length limits, an abort, preemption and block openings all
    happen in one run (tight KV, block size 4); every choice must get exactly the
    tokens it gets alone (greedy, or seeded), with the same finish."""
    tight = LLM(
        tiny_gpt2_dir,
        device="cpu",
        block_size=4,
        max_model_len=96,
        num_kv_blocks=28,  # long requests preempt the newest
        max_num_seqs=6,
        max_num_batched_tokens=32,
    )
    rows = count_rows(tight.engine)
    mixed = drive(tight.engine, PLANS, every=9, abort=(90, "r7"))
    assert tight.engine.scheduler.num_preemptions > 0
    assert mixed[("r7", 0)][1] is None  # aborted: no final output
    roomy = LLM(tiny_gpt2_dir, device="cpu", block_size=4, max_model_len=96)
    for i, plan in enumerate(PLANS[:-1]):
        alone = drive(roomy.engine, [plan], every=1, abort=None)
        for (_, index), got in alone.items():
            assert mixed[(f"r{i}", index)] == got, (i, index)
    assert rows["r0"] >= 40  # long requests decoded through many block openings


@pytest.mark.parametrize("max_tokens", [3, 4, 5])
def test_a_length_limit_costs_no_extra_row(tiny_gpt2_dir, max_tokens):
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


def test_rows_that_score_their_prompts_are_counted_until_scored_or_gone():
    batch = InputBatch(4, 64, 64)
    a, b = request("a", [1, 2, 3], prompt_logprobs=1), request("b", [4], prompt_logprobs=1)
    c = request("c", [5, 6])
    for r in (a, b, c):
        batch.add(r)
    # b's one-token prompt has nothing to score; c asked for nothing.
    assert batch.scores_prompt[[a.slot, b.slot, c.slot]].tolist() == [True, False, False]
    assert batch.num_scoring == 1
    batch.remove(a)  # aborted or preempted mid-prefill
    assert batch.num_scoring == 0 and not batch.scores_prompt.any()
    batch.add(a)
    batch.prompt_scored(a.slot)
    batch.prompt_scored(a.slot)  # twice (scored, then it left): counted once
    assert batch.num_scoring == 0


def counted(batch: InputBatch) -> dict[str, int]:
    """The batch's row counts, and the same counts taken from its rows."""
    slots = batch.slots
    stopping = int((batch.stop_ids[slots] >= 0).any(1).sum())
    awaiting = int((batch.num_known[slots] == batch.num_prompt[slots]).sum())
    fully = int((~batch.argmax_only[slots]).sum())
    kept = (batch.num_stopping, batch.num_awaiting_first, batch.num_sampled_fully)
    return {"kept": kept, "rows": (stopping, awaiting, fully)}


def test_row_counts_follow_adds_reads_and_removals():
    batch = InputBatch(4, 64, 64)
    plain = request("plain", [1, 2], temperature=0.0)  # EOS stops it
    ignores = request("ignores", [3], ignore_eos=True, temperature=0.0)  # no stop id at all
    sampled = request("sampled", [4], ignore_eos=True, temperature=0.8, stop_token_ids=[9])
    for r in (plain, ignores, sampled):
        batch.add(r)
    assert counted(batch) == {"kept": (2, 3, 1), "rows": (2, 3, 1)}
    got = sample(batch, [plain, ignores], [5, 6])  # their first tokens
    assert got.first.tolist() == [True, True]
    assert counted(batch)["kept"] == counted(batch)["rows"] == (2, 1, 1)
    got = sample(batch, [plain, ignores, sampled], [7, 8, 10])
    assert got.first.tolist() == [False, False, True]
    assert counted(batch)["kept"] == counted(batch)["rows"] == (2, 0, 1)
    assert sample(batch, [plain], [11]).first is None  # nobody awaits a first token
    batch.remove(sampled)
    assert counted(batch)["kept"] == counted(batch)["rows"] == (1, 0, 0)
    fresh = request("fresh", [12, 13], stop_token_ids=[9], top_p=0.5)
    batch.add(fresh)
    batch.remove(fresh)  # preempted before its first token
    assert counted(batch)["kept"] == counted(batch)["rows"] == (1, 0, 0)
    batch.remove(plain)
    batch.add(plain)  # back, its outputs with it: not awaiting a first token
    assert counted(batch)["kept"] == counted(batch)["rows"] == (1, 0, 0)


def test_layout_changes_whenever_the_running_slots_do():
    batch = InputBatch(4, 64, 64)
    a, b = request("a", [1, 2]), request("b", [3])
    layouts = [batch.layout]
    for r in (a, b):
        batch.add(r)
        layouts.append(batch.layout)
    sample(batch, [a, b], [5, 6])  # a step changes counts, not slots
    assert batch.layout == layouts[-1]
    batch.remove(a)
    layouts.append(batch.layout)
    batch.add(a)  # back in the same slot: another layout all the same
    layouts.append(batch.layout)
    assert len(set(layouts)) == len(layouts)


def test_headroom_bounds_every_rows_room_and_unscheduled_tokens_are_kept_summed():
    batch = InputBatch(4, 64, 64)
    a = request("a", [1, 2, 3], max_tokens=5, ignore_eos=True, final_only=True)  # limit 8
    b = request("b", [4], max_tokens=2, ignore_eos=True, final_only=True)  # limit 3

    def check() -> None:
        slots = batch.slots
        room = batch.max_num_tokens[slots] - batch.num_tokens[slots]
        assert batch.headroom <= room.min()
        unscheduled = batch.num_tokens[slots] - batch.num_computed[slots]
        assert batch.num_unscheduled == unscheduled.sum()

    for r in (a, b):
        batch.add(r)
        check()
    assert batch.headroom == 2 and batch.num_unscheduled == 4
    batch.scheduled(batch.slots, batch.num_tokens[batch.slots], 4)  # both prompts, whole
    check()
    assert batch.num_unscheduled == 0
    got = sample(batch, [a, b], [7, 8])  # first tokens: headroom 1, no limit reached
    check()
    assert got.done is None and got.first.all()
    batch.scheduled(batch.slots, batch.num_tokens[batch.slots], 2)
    got = sample(batch, [a, b], [9, 10])  # b reaches its limit: the bound sent a look
    check()
    assert batch.headroom <= 0 and got.done.tolist() == [False, True]
    a.num_computed_tokens = 1  # a recompute from position 1, say
    check()
    batch.remove(b)  # it finished; the bound stays a bound
    check()
    assert sample(batch, [a], [11]) is None  # nothing any row needs looked at
    check()


def test_a_row_voided_before_its_launch_counts_no_token():
    batch = InputBatch(4, 64, 64)
    a, b = request("a", [1, 2], ignore_eos=True), request("b", [3], ignore_eos=True)
    for r in (a, b):
        batch.add(r)
    slots = batch.slots.copy()
    batch.scheduled(slots, batch.num_tokens[slots], 3)
    b.status = RequestStatus.FINISHED
    batch.remove(b)  # a read just before sampling finished it
    mark = batch.launched(slots, void=np.array([False, True]))
    assert batch.num_unscheduled == 1  # a's token, not b's
    got = batch.read(slots, mark, np.array([5, 6]))
    assert got.slots.tolist() == [a.slot] and a.output_token_ids == [5]
    assert b.output_token_ids == []
