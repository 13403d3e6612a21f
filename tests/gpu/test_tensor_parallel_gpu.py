"""Tensor parallelism on two GPUs (NCCL, with small sums one-shot, or all NCCL's):
the same greedy tokens as one GPU and as transformers, with CUDA graphs (decode and
prefill, the collectives captured inside) and without; a rank killed mid-generation fails
the engine, which then shuts down."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.loader import load_tokenizer
from engine.one_shot import rendezvous_made
from tests.gpu.on_cuda import GPU
from tests.reference import PROMPTS, hf_greedy

pytestmark = [
    *GPU,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

MAX_NEW = 16


@dataclass
class Generated:
    tokens: list[list[int]]
    paths: dict[str, int]  # steps by path (graph, prefill graph, eager)
    one_shot: bool  # small sums on engine/one_shot.py


def generate(model_dir: str, prompts: list[str], **config) -> Generated:
    """fp32, so that a sharded model's reductions cannot flip a near-tie."""
    llm = LLM(model_dir, device="cuda", dtype="float32", max_num_seqs=16, **config)
    try:
        params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runner = llm.engine.runner
        tokens = [o.outputs[0].token_ids for o in outs]
        return Generated(tokens, dict(runner.steps_by_path), runner.tp.one_shot is not None)
    finally:
        llm.shutdown()


GENERATE = """
import dataclasses, json, sys
from tests.gpu.test_tensor_parallel_gpu import generate
got = generate(sys.argv[1], json.loads(sys.argv[2]), **json.loads(sys.argv[3]))
print(json.dumps(dataclasses.asdict(got)))
"""


def generate_apart(model_dir: str, prompts: list[str], **config) -> Generated:
    """generate() in a process of its own: the first engine of a process is the one that
    sums small tensors one-shot (engine/one_shot.py says why)."""
    args = [model_dir, json.dumps(prompts), json.dumps(config)]
    out = subprocess.run(
        [sys.executable, "-c", GENERATE, *args], capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-8000:]
    return Generated(**json.loads(out.stdout.splitlines()[-1]))


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_two_gpus_give_one_gpus_tokens(tiny_model_dir, eager):
    # A 40-token budget chunks the longer prompts: steps mix prefill chunks and decodes.
    prompts = [p * 3 for p in PROMPTS]
    config = dict(max_num_batched_tokens=40, enforce_eager=eager)
    want = generate(tiny_model_dir, prompts, **config).tokens
    tp2 = generate_apart(tiny_model_dir, prompts, tensor_parallel_size=2, **config)
    got, paths = tp2.tokens, tp2.paths
    assert tp2.one_shot  # on by default
    assert got == want
    tokenizer = load_tokenizer(tiny_model_dir)
    assert got == [hf_greedy(tiny_model_dir, tokenizer.encode(p), MAX_NEW) for p in prompts]
    if eager:
        assert paths["graph"] == paths["prefill graph"] == 0
    else:
        assert paths["graph"] > 0 and paths["prefill graph"] > 0


def test_nccl_all_reduces_give_one_gpus_tokens(tiny_llama_dir):
    prompts = [p * 3 for p in PROMPTS]
    config = dict(max_num_batched_tokens=40)
    want = generate(tiny_llama_dir, prompts, **config).tokens
    got = generate(
        tiny_llama_dir, prompts, tensor_parallel_size=2, custom_all_reduce=False, **config
    )
    assert got.tokens == want and got.paths["graph"] > 0 and not got.one_shot


def test_engines_after_the_first_in_a_process_sum_on_nccl(tiny_llama_dir):
    # Shared prefixes and few KV blocks, too.
    shared = PROMPTS[5] * 2
    prompts = [shared + s for s in ("", " one", " two", " three")] + PROMPTS
    config = dict(block_size=16, num_kv_blocks=24, max_model_len=128)
    want = generate(tiny_llama_dir, prompts, **config).tokens
    fresh = rendezvous_made() == 0  # no engine of this process has set one up
    first = generate(tiny_llama_dir, prompts, tensor_parallel_size=2, **config)
    second = generate(tiny_llama_dir, prompts, tensor_parallel_size=2, **config)
    assert first.tokens == second.tokens == want
    assert first.one_shot == fresh and not second.one_shot


# In a process of its own, so that a hang (NCCL waiting on the dead rank, or its
# teardown waiting on graphs that captured its collectives) fails the test.
KILL_A_RANK = """
import faulthandler, os, signal, sys, time
from engine import LLM, SamplingParams
from engine.distributed import WorkerFailed

llm = LLM(sys.argv[1], device="cuda", dtype="float32", tensor_parallel_size=2,
          enforce_eager=sys.argv[2] == "eager", custom_all_reduce=sys.argv[2] != "nccl")
engine = llm.engine
print(f"one-shot {engine.runner.tp.one_shot is not None}", flush=True)
(worker,) = engine.workers.processes.values()
params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
engine.add_request("r", [1, 2, 3, 4], params)
for _ in range(4):
    engine.step()
os.kill(worker.pid, signal.SIGKILL)
killed = time.monotonic()
faulthandler.dump_traceback_later(60, exit=True)  # a hang shows every thread's stack
try:
    while engine.has_unfinished_requests():
        engine.step()
    print("finished without failing", flush=True)
except WorkerFailed as exc:
    print(f"failed after {time.monotonic() - killed:.3f} s: {exc}", flush=True)
llm.shutdown()
print("shut down", flush=True)
"""


# graphs and eager: small all-reduces wait at engine/one_shot.py's barriers, which NCCL's
# abort does not end; nccl: graphs whose every collective is NCCL's.
@pytest.mark.parametrize("mode", ["graphs", "eager", "nccl"])
def test_a_killed_rank_fails_the_engine_which_then_shuts_down(tiny_llama_dir, mode):
    try:
        out = subprocess.run(
            [sys.executable, "-c", KILL_A_RANK, tiny_llama_dir, mode],
            capture_output=True,
            text=True,
            timeout=240,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hung after the kill; its output: {exc.stdout!r} {exc.stderr!r}")
    lines = out.stdout.splitlines()
    assert f"one-shot {mode != 'nccl'}" in lines, out.stdout + out.stderr[-8000:]
    failed = [line for line in lines if line.startswith("failed after")]
    assert failed, out.stdout + out.stderr[-8000:]
    assert "rank 1" in failed[0]
    assert float(failed[0].split()[2]) < 10.0
    assert lines[-1] == "shut down", out.stderr[-8000:]
