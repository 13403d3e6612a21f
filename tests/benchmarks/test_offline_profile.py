"""benchmarks.offline's decode-step profile returns, and times only full-batch decode steps."""

from __future__ import annotations

import pytest

from benchmarks.decode_step import profile_decode_step, start_decoding
from engine import LLM

BATCH, CONTEXT, STEPS, WARMUP = 8, 64, 4, 4


@pytest.fixture(scope="module")
def llm():
    # A step's budget of 16 tokens prefills a 64-token prompt over 4+ steps, less as
    # decodes take their share: the batch fills long after its first request decodes.
    return LLM(
        None,
        device="cpu",
        max_num_seqs=BATCH,
        max_num_batched_tokens=16,
        max_model_len=256,
        enable_prefix_caching=False,
    )


def test_profile_returns_when_early_requests_would_finish_before_the_last_is_admitted(llm):
    result = profile_decode_step(llm, BATCH, CONTEXT, steps=STEPS, warmup=WARMUP)
    # The first request decoded more tokens while the others were admitted than the
    # timed part needs: sized to the timed part alone, it would have ended first.
    assert result["admission_steps"] > WARMUP + 2 * STEPS + 8
    assert (result["batch"], result["steps"]) == (BATCH, STEPS)
    assert result["step_us"] > 0 and result["host_work_us"] > 0
    assert set(result["host_phases_us"]) == {"schedule", "prepare_launch", "sample_launch", "other"}
    assert all(v > 0 for v in result["host_phases_us"].values())
    assert "gpu_step_us" not in result  # no CUDA graphs on the CPU
    assert not llm.engine.has_unfinished_requests()  # its requests are gone: reusable

    again = profile_decode_step(llm, BATCH, CONTEXT, steps=STEPS, warmup=WARMUP)
    assert again["admission_steps"] == result["admission_steps"]


def test_start_decoding_raises_instead_of_stepping_an_emptied_engine(llm):
    with pytest.raises(RuntimeError, match="before all 8 were decoding"):
        start_decoding(llm.engine, BATCH, CONTEXT, max_tokens=4)
    for i in range(BATCH):
        llm.engine.abort_request(f"p{i}")
    assert not llm.engine.has_unfinished_requests()


def test_profile_refuses_a_window_the_requests_cannot_outlast(llm):
    with pytest.raises(ValueError, match="lower steps or context"):
        profile_decode_step(llm, BATCH, CONTEXT, steps=200, warmup=WARMUP)
    for i in range(BATCH):
        llm.engine.abort_request(f"p{i}")


def test_start_decoding_gives_each_request_its_own_prompt(llm):
    # One prompt repeated would send every sequence of an MoE model to the same experts.
    start_decoding(llm.engine, BATCH, CONTEXT, max_tokens=120)
    prompts = {tuple(r.prompt_token_ids) for r in llm.engine.scheduler.running}
    assert len(prompts) == BATCH
    assert all(len(p) == CONTEXT and min(p) > 0 and max(p) < llm.engine.vocab_size for p in prompts)
    for i in range(BATCH):
        llm.engine.abort_request(f"p{i}")
    assert not llm.engine.has_unfinished_requests()
