"""Tensor parallelism on CPU: two ranks (gloo) give transformers' greedy output token
for token (Llama with kv heads that split evenly and that do not; Qwen 3.5's recurrent
layers), through chunked prefill, prefix-cache hits and preemption.

One TP=2 LLM per checkpoint serves every test here (spawning a rank costs seconds
on a small machine); its config makes every run chunk its prompts (a 16-token
budget), preempt (24 blocks of 4 tokens for up to 4 sequences of ~30 tokens) and
find shared prefixes cached. test_tensor_parallel_replica.py checks the other
rank's side directly.
"""

from __future__ import annotations

import socket

import pytest

from engine import LLM, SamplingParams
from engine.models.loader import load_tokenizer
from engine.tp_group import host_rendezvous
from tests.reference import PROMPTS, hf_greedy

MAX_NEW = 12
CONFIG = dict(
    device="cpu",
    block_size=4,
    num_kv_blocks=24,
    max_model_len=64,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    enable_prefix_caching=True,  # a recurrent model's too: its states' snapshots
)


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, **kwargs)


def token_ids(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]


# llama_kv3: 3 kv heads over 2 ranks, so a rank holds one kv head twice. qwen3_5: Gated
# DeltaNet layers, whose states each rank copies to and from snapshots as rank 0 says.
@pytest.fixture(scope="module", params=["gpt2", "llama", "llama_kv3", "qwen2", "qwen3_5"])
def model_dir(request, tiny_family_dir) -> str:
    if request.param == "qwen3_5":
        return tiny_family_dir(request.param)
    return request.getfixturevalue(f"tiny_{request.param}_dir")


@pytest.fixture(scope="module")
def tp2(model_dir):
    # The one-shot all-reduce (on by default) is CUDA's: on gloo every sum stays gloo's.
    llm = LLM(model_dir, tensor_parallel_size=2, **CONFIG)
    assert llm.engine.runner.tp.one_shot is None
    yield llm
    llm.shutdown()
    assert all(not p.is_alive() for p in llm.engine.workers.processes.values())


@pytest.fixture(scope="module")
def tp1(model_dir) -> LLM:
    return LLM(model_dir, **CONFIG)


def expected(model_dir: str, prompts: list[str]) -> list[list[int]]:
    tokenizer = load_tokenizer(model_dir)
    return [hf_greedy(model_dir, tokenizer.encode(p), MAX_NEW) for p in prompts]


def test_greedy_matches_one_rank_and_transformers_through_preemption(model_dir, tp2, tp1):
    prompts = PROMPTS[1:7]
    preempted = tp2.engine.scheduler.num_preemptions
    got = token_ids(tp2, prompts)
    assert got == expected(model_dir, prompts)
    assert got == token_ids(tp1, prompts)
    assert tp2.engine.scheduler.num_preemptions > preempted
    assert tp2.engine.blocks.num_free_blocks == CONFIG["num_kv_blocks"]


def test_prefix_cache_hits_give_the_same_tokens(model_dir, tp2):
    shared = PROMPTS[5]  # ~20 tokens: several full 4-token blocks
    prompts = [shared, shared + " one", shared + " two"]
    outs = tp2.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected(model_dir, prompts)
    assert sum(o.num_cached_tokens for o in outs) > 0


def test_prompt_logprobs_match_one_rank(tp2, tp1):
    """Scoring steps run compute_logits on every rank (their rows are broadcast)."""
    prompts = PROMPTS[3:5]
    params = greedy(prompt_logprobs=2)
    got = tp2.generate(prompts, params, use_tqdm=False)
    want = tp1.generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want):
        # Sharded matmuls sum in another order: the same tokens and ranks, logprobs
        # equal to fp32 rounding.
        assert g.prompt_logprobs[0] is None and w.prompt_logprobs[0] is None
        for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:], strict=True):
            assert (a.token_id, a.rank) == (b.token_id, b.rank)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [p for _, p in a.top] == pytest.approx([p for _, p in b.top], abs=1e-4)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_the_scaling_benchmark_finds_rank_zeros_collectives(tp2):
    """benchmarks.tp_scaling's profiled share (gloo's host ops here, NCCL's kernels on
    GPUs): every step all-reduces, and the collectives are part of the step's time."""
    from benchmarks.tp_scaling import collective_share

    share = collective_share(tp2, list(range(10, 30)), tokens=4)
    assert 0 < share["collective_us_per_token"] < share["step_us"]
    assert not tp2.engine.has_unfinished_requests()


def test_the_rendezvous_port_stays_bound_from_the_moment_it_is_chosen():
    """Port 0 picks a free port that node 0's store holds: no other process can take it
    before the ranks connect, and a rank's client reaches that store."""
    store, rendezvous = host_rendezvous("127.0.0.1", 0)
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", rendezvous.port))
    rendezvous.connect().set("rank 1", b"here")
    assert store.get("rank 1") == b"here"


def test_the_collective_gate_keeps_an_abort_out_of_a_call_and_later_calls_out():
    import threading

    from engine.distributed import CollectiveGate, WorkerFailed

    gate = CollectiveGate()
    events: list[str] = []
    inside, release = threading.Event(), threading.Event()

    def a_call() -> None:
        with gate.call():
            inside.set()
            release.wait(5.0)
            events.append("call ends")

    caller = threading.Thread(target=a_call)
    caller.start()
    inside.wait(5.0)
    aborter = threading.Thread(
        target=gate.abort, args=("rank 1 died", lambda: events.append("abort"))
    )
    aborter.start()
    aborter.join(0.05)
    assert aborter.is_alive() and events == []  # the abort waits for the call to end
    release.set()
    caller.join(5.0)
    aborter.join(5.0)
    assert events == ["call ends", "abort"]
    ran = []
    with pytest.raises(WorkerFailed, match="rank 1 died"), gate.call():
        ran.append(1)  # never: the group is gone
    assert ran == []
    gate.open()  # a new group
    with gate.call():
        ran.append(1)
    assert ran == [1]


def test_the_collective_gate_aborts_past_a_call_that_never_returns():
    import threading

    from engine.distributed import CollectiveGate

    gate = CollectiveGate()
    inside, release = threading.Event(), threading.Event()

    def stuck() -> None:
        with gate.call():
            inside.set()
            release.wait(10.0)  # a call blocked on the dead rank: only the abort ends it

    caller = threading.Thread(target=stuck)
    caller.start()
    inside.wait(5.0)
    gate.abort("rank 1 died", release.set, wait_s=0.1)
    caller.join(5.0)
    assert not caller.is_alive() and gate.closed == "rank 1 died"
