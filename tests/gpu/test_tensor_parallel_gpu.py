"""Tensor parallelism on two GPUs (NCCL): the same greedy tokens as one GPU and as
transformers, with CUDA graphs (decode and prefill, the collectives captured inside) and
without; a rank killed mid-generation fails the engine, which then shuts down."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.loader import load_tokenizer
from tests.conftest import PROMPTS, hf_greedy
from tests.gpu.conftest import GPU

pytestmark = [
    *GPU,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

MAX_NEW = 16


def generate(model_dir: str, prompts: list[str], **config) -> tuple[list[list[int]], dict]:
    """fp32, so that a sharded model's reductions cannot flip a near-tie."""
    llm = LLM(model_dir, device="cuda", dtype="float32", max_num_seqs=16, **config)
    try:
        one_shot = config.get("custom_all_reduce", False)  # small sums on engine/one_shot.py
        assert (llm.engine.runner.tp.one_shot is not None) == one_shot
        params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], dict(llm.engine.runner.steps_by_path)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_two_gpus_give_one_gpus_tokens(tiny_model_dir, eager):
    # A 40-token budget chunks the longer prompts: steps mix prefill chunks and decodes.
    prompts = [p * 3 for p in PROMPTS]
    config = dict(max_num_batched_tokens=40, enforce_eager=eager)
    want, _ = generate(tiny_model_dir, prompts, **config)
    got, paths = generate(tiny_model_dir, prompts, tensor_parallel_size=2, **config)
    assert got == want
    tokenizer = load_tokenizer(tiny_model_dir)
    assert got == [hf_greedy(tiny_model_dir, tokenizer.encode(p), MAX_NEW) for p in prompts]
    if eager:
        assert paths["graph"] == paths["prefill graph"] == 0
    else:
        assert paths["graph"] > 0 and paths["prefill graph"] > 0


def test_one_shot_all_reduces_give_one_gpus_tokens(tiny_llama_dir):
    prompts = [p * 3 for p in PROMPTS]
    config = dict(max_num_batched_tokens=40)
    want, _ = generate(tiny_llama_dir, prompts, **config)
    got, paths = generate(
        tiny_llama_dir, prompts, tensor_parallel_size=2, custom_all_reduce=True, **config
    )
    assert got == want and paths["graph"] > 0


def test_shared_prefixes_and_few_kv_blocks_on_two_gpus(tiny_llama_dir):
    shared = PROMPTS[5] * 2
    prompts = [shared + s for s in ("", " one", " two", " three")] + PROMPTS
    config = dict(block_size=16, num_kv_blocks=24, max_model_len=128)
    want, _ = generate(tiny_llama_dir, prompts, **config)
    got, _ = generate(tiny_llama_dir, prompts, tensor_parallel_size=2, **config)
    assert got == want


# In a process of its own, so that a hang (NCCL waiting on the dead rank, or its
# teardown waiting on graphs that captured its collectives) fails the test.
KILL_A_RANK = """
import faulthandler, os, signal, sys, time
from engine import LLM, SamplingParams
from engine.distributed import WorkerFailed

llm = LLM(sys.argv[1], device="cuda", dtype="float32", tensor_parallel_size=2,
          enforce_eager=sys.argv[2] == "eager", custom_all_reduce=sys.argv[2] == "one-shot")
engine = llm.engine
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


# one-shot: graphs whose small all-reduces wait at engine/one_shot.py's barriers, which
# NCCL's abort does not end.
@pytest.mark.parametrize("mode", ["graphs", "eager", "one-shot"])
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
    failed = [line for line in lines if line.startswith("failed after")]
    assert failed, out.stdout + out.stderr[-8000:]
    assert "rank 1" in failed[0]
    assert float(failed[0].split()[2]) < 10.0
    assert lines[-1] == "shut down", out.stderr[-8000:]
