"""Scheduler: token budget, chunked prefill, slots, preemption newest-first (or by
priority)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.block_table import BlockTable
from engine.config import EngineConfig
from engine.input_batch import InputBatch
from engine.kv_cache import BlockManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.staging import WaitClock


def setup(num_blocks=64, block_size=4, **config) -> Scheduler:
    config = EngineConfig(block_size=block_size, max_model_len=256, **config)
    batch = InputBatch(config.max_num_seqs, config.max_model_len, 64)
    table = BlockTable(
        config.max_num_seqs,
        config.max_blocks_per_seq(256),
        block_size,
        torch.device("cpu"),
        WaitClock(),
    )
    return Scheduler(config, BlockManager(num_blocks, block_size, True), batch, table)


def req(name: str, n: int) -> Request:
    return Request(name, list(range(1, n + 1)), SamplingParams())


def prioritized(name: str, n: int, priority: int) -> Request:
    """n tokens of a prompt of its own (no prefix-cache hits between them)."""
    first = 1 + 32 * (ord(name) % 8)
    return Request(name, list(range(first, first + n)), SamplingParams(priority=priority))


def requests_of(sched: Scheduler, out: SchedulerOutput) -> list[Request]:
    return [sched.batch.requests[s] for s in out.slots.tolist()]


def launch(sched: Scheduler, out: SchedulerOutput) -> np.ndarray:
    """The step's sampling rows sampled on the device: their ids are in flight."""
    return sched.batch.launched(out.sampling_slots)


def read(sched: Scheduler, out: SchedulerOutput, mark: np.ndarray, token: int = 7):
    slots = out.sampling_slots
    sched.batch.read(slots, mark, np.full(len(slots), token))


def run_step(sched: Scheduler) -> dict[str, int]:
    """Schedule, then pretend the model ran and its ids were read at once: token 7."""
    out = sched.schedule()
    read(sched, out, launch(sched, out))
    for r in requests_of(sched, out):
        sched.blocks.cache_full_blocks(r)
    return {
        r.request_id: int(n)
        for r, n in zip(requests_of(sched, out), out.num_new_tokens, strict=True)
    }


def entry(out: SchedulerOutput, i: int = 0) -> tuple[int, int, bool]:
    """(start, num_new_tokens, samples) of the i-th scheduled request."""
    return int(out.starts[i]), int(out.num_new_tokens[i]), bool(out.samples[i])


def test_budget_chunks_prefill_and_keeps_decodes_first():
    sched = setup(max_num_batched_tokens=8)
    sched.add(req("a", 3))
    sched.add(req("b", 20))
    assert run_step(sched) == {"a": 3, "b": 5}
    assert run_step(sched) == {"a": 1, "b": 7}  # a decodes, b continues its prefill
    assert run_step(sched) == {"a": 1, "b": 7}
    assert run_step(sched) == {"a": 1, "b": 1}  # b's prefill finished last step: decoding


def test_max_num_seqs_limits_running():
    sched = setup(max_num_seqs=2)
    for name in "abc":
        sched.add(req(name, 2))
    assert set(run_step(sched)) == {"a", "b"}
    assert len(sched.waiting) == 1
    sched.finish(sched.running[0], "stop")
    assert "c" in run_step(sched)


def test_slots_are_unique_and_recycled():
    sched = setup(max_num_seqs=3)
    for name in "abc":
        sched.add(req(name, 2))
    run_step(sched)
    assert sorted(r.slot for r in sched.running) == [0, 1, 2]
    freed = sched.running[1].slot
    sched.finish(sched.running[1], "abort")
    sched.add(req("d", 2))
    run_step(sched)
    assert sched.running[-1].slot == freed


def test_preempts_newest_when_blocks_run_out():
    # 4 blocks of 4 tokens; two requests of 8 tokens fill 2 blocks each.
    sched = setup(num_blocks=4)
    a, b = req("a", 8), req("b", 8)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prefill; each now has a 9th token to compute
    run_step(sched)  # each needs a third block: b (newest) is preempted
    assert b.status == RequestStatus.PREEMPTED and sched.waiting[0] is b
    assert b.num_computed_tokens == 0 and b.block_ids == []
    assert b.output_token_ids == [7]  # generated tokens survive and are recomputed
    assert sched.num_preemptions >= 1
    assert a.status == RequestStatus.RUNNING


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_victim_by_policy(policy):
    """x and y (7 tokens, 2 blocks each) run, then z (8 tokens) fills the last 2 of 6
    blocks; then each needs a third. fcfs preempts the newest (z); priority the last in
    (priority, arrival) order, y, which runs between x and z."""
    sched = setup(num_blocks=6, scheduling_policy=policy)
    x, y, z = (prioritized(name, n, p) for name, n, p in (("x", 7, 0), ("y", 7, 1), ("z", 8, 0)))
    sched.add(x)
    sched.add(y)
    assert run_step(sched) == {"x": 7, "y": 7}
    sched.add(z)
    assert run_step(sched) == {"x": 1, "y": 1, "z": 8}
    victim = z if policy == "fcfs" else y
    assert run_step(sched) == {r.request_id: 1 for r in (x, y, z) if r is not victim}
    assert victim.status == RequestStatus.PREEMPTED and victim.block_ids == []
    assert list(sched.waiting) == [victim]


def test_priority_orders_admission_and_requeued_requests():
    sched = setup(max_num_seqs=2, scheduling_policy="priority")
    a, b, c, d = (prioritized(n, 2, p) for n, p in (("a", 5), ("b", 0), ("c", 5), ("d", -1)))
    for r in (a, b, c, d):
        sched.add(r)
    assert list(sched.waiting) == [d, b, a, c]  # by priority, then arrival
    assert run_step(sched) == {"d": 2, "b": 2}
    sched.finish(d, "length")
    assert run_step(sched) == {"b": 1, "a": 2}
    e = prioritized("e", 2, 5)
    sched.add(e)  # after a and c: same priority, later arrival
    sched._preempt(a)
    assert list(sched.waiting) == [a, c, e]  # a keeps its arrival's place


def test_finish_frees_everything():
    sched = setup(num_blocks=8)
    r = req("a", 9)
    sched.add(r)
    run_step(sched)
    sched.finish(r, "length")
    assert sched.blocks.num_free_blocks == 8
    assert sched.num_unfinished == 0 and r.slot == -1


def test_sibling_waits_for_first_choice_prefill():
    sched = setup(max_num_batched_tokens=4)
    first = req("a", 8)
    second = Request("a", list(range(1, 9)), SamplingParams(), index=1, wait_for=first)
    sched.add(first)
    sched.add(second)
    assert run_step(sched) == {"a": 4}  # only the first choice's chunk
    assert second.status == RequestStatus.WAITING
    run_step(sched)  # first finishes its prefill
    run_step(sched)
    assert second.status == RequestStatus.RUNNING
    assert second.num_cached_tokens == 4  # it found the prompt's full block


def test_token_in_flight_is_scheduled_before_the_host_reads_it():
    sched = setup()
    a = req("a", 5)
    sched.add(a)
    out = sched.schedule()
    assert entry(out) == (0, 5, True)
    mark = launch(sched, out)  # sampled on the device; the host has not read it
    assert a.num_inflight == 1
    # The unread token is the next input: position 5, one past the known tokens.
    assert entry(sched.schedule()) == (5, 1, True)
    assert a.num_computed_tokens == 6 and a.num_tokens == 5
    read(sched, out, mark)
    assert a.num_tokens == 6 and a.num_inflight == 0 and a.output_token_ids == [7]


def test_length_reached_in_flight_is_not_scheduled_again():
    sched = setup()
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=1))
    b = req("b", 3)
    sched.add(a)
    sched.add(b)
    launch(sched, sched.schedule())
    # a's only token is on the device: it finishes when read, so it gets no row.
    assert requests_of(sched, sched.schedule()) == [b]


def test_a_token_in_flight_when_preempted_is_read_into_the_request():
    sched = setup(num_blocks=4)
    a, b = req("a", 8), req("b", 8)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    mark = launch(sched, out)  # both prefilled; their first ids are on the device
    sched.schedule()  # each needs a third block: b (newest) is preempted, its id in flight
    assert b.status == RequestStatus.PREEMPTED and b.num_inflight == 1
    sched.finish(a, "stop")  # room again, but b's last token is still unread
    assert requests_of(sched, sched.schedule()) == []
    read(sched, out, mark)  # a's id is void (finished), b's is its own
    assert b.num_inflight == 0 and b.output_token_ids == [7]
    # Its prompt's two full blocks are cached; the rest, the read token included, is recomputed.
    out = sched.schedule()
    assert requests_of(sched, out) == [b] and entry(out) == (8, 1, True)
    assert b.num_computed_tokens == 9


def test_a_decode_batch_replays_the_smallest_bucket_that_holds_it():
    config = EngineConfig(max_num_seqs=20)
    assert config.cuda_graph_batch_sizes() == [1, 2, 4, 8, 16, 20]
    table = config.cuda_graph_bucket_table()
    assert table[1:] == [1, 2, 4, 4, 8, 8, 8, 8, 16, 16, 16, 16, 16, 16, 16, 16, 20, 20, 20, 20]


def test_given_cuda_graph_sizes_replace_the_buckets_below_max_num_seqs():
    config = EngineConfig(max_num_seqs=20, cuda_graph_sizes=[16, 4, 64, 4])
    assert config.cuda_graph_batch_sizes() == [4, 16, 20]
    assert config.cuda_graph_bucket_table()[1:] == [4] * 4 + [16] * 12 + [20] * 4
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        EngineConfig(cuda_graph_sizes=[0, 8])


def test_prefill_graph_token_buckets_double_then_step_by_256_to_the_budget():
    sizes = EngineConfig(max_num_batched_tokens=2048).prefill_graph_sizes()
    assert sizes == [16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert EngineConfig(max_num_batched_tokens=40).prefill_graph_sizes() == [16, 32, 40]
    assert EngineConfig(max_num_batched_tokens=8192).prefill_graph_sizes()[-1] == 2048


def test_the_offline_budget_follows_the_gpu_memory_unless_given(monkeypatch):
    memory = {"total_memory": 80 * 2**30}

    def properties(device):
        return type("Properties", (), memory)

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    for given, total, budget in ((None, 80, 16384), (None, 24, 8192), (4096, 80, 4096)):
        memory["total_memory"] = total * 2**30
        config = EngineConfig(device="cuda", max_num_batched_tokens=given)
        config.offline_step_budget()
        assert config.max_num_batched_tokens == budget
    config = EngineConfig(device="cpu")  # the engine's default: no launches to amortize
    config.offline_step_budget()
    assert config.max_num_batched_tokens == 2048
    config = EngineConfig(device="cuda")
    config.offline_step_budget()
    config.encoder_only()  # an encoder's own default still wins
    assert config.max_num_batched_tokens == 32768


def test_only_requests_that_gained_blocks_are_grown():
    sched = setup(block_size=4)
    sched.add(req("a", 3))
    sched.add(req("b", 4))
    run_step(sched)  # both admitted: both rows start fresh
    table = sched.block_table
    assert table.num_blocks[:2].tolist() == [1, 1]
    grown = []
    for _ in range(5):
        before = np.array(table.num_blocks[:2])
        out = sched.schedule()
        assert not out.admitted
        read(sched, out, launch(sched, out))
        grew = np.flatnonzero(np.array(table.num_blocks[:2]) > before).tolist()
        grown.append(sorted(sched.batch.requests[s].request_id for s in grew))
    # Tokens at positions 4 and 8 open a block: b's first decode, a's second, b's fifth.
    assert grown == [["b"], ["a"], [], [], ["b"]]


def test_a_one_token_prefill_chunk_beside_decodes_is_no_decode_step():
    # a decodes; b gets the budget's last token, one of its prompt's 5: it samples nothing.
    sched = setup(max_num_batched_tokens=2)
    sched.add(req("a", 2))
    run_step(sched)
    sched.add(req("b", 5))
    out = sched.schedule()
    assert [entry(out, i) for i in range(2)] == [(2, 1, True), (0, 1, False)]
    assert not out.is_decode_only
    assert out.sampling_slots.tolist() == [sched.running[0].slot]
