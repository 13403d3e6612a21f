"""benchmarks.offline's decode steps against their floors, the llama3-8b shape, the
transformers static-cache timing's arguments and streamer (the CPU-runnable parts), and
its refusal to batch one repeated prompt on an MoE model."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.checkpoints import write_random_adapters
from benchmarks.floors import DecodeStep, decode_vs_floor, kv_bytes_per_token, weight_bytes
from benchmarks.hf_compile import TokenTimes, per_token_ms, static_generate_kwargs
from benchmarks.offline import main, routes_experts, run_pagoda
from engine import LLM


@pytest.fixture(scope="module")
def llm():
    return LLM(None, device="cpu", max_num_seqs=4, max_model_len=128)


def test_run_pagoda_records_each_decode_step_with_its_batch_and_context(llm):
    prompts = [[1] * 5, [2] * 9, [3] * 3]
    steps: list[DecodeStep] = []
    result = run_pagoda(llm, prompts, [6, 6, 6], steps)
    assert result["decode_step_ms"]["count"] == len(steps) > 0
    assert "schedule" not in vars(llm.engine.scheduler)  # the recording hook is gone
    # Prompts prefill together in the first step, then all three decode to the end,
    # each step's context one token per sequence longer than the last's.
    assert all(s.batch == 3 for s in steps)
    assert [s.context for s in steps] == [17 + 3 * i for i in range(1, len(steps) + 1)]
    assert all(s.seconds > 0 for s in steps)


def test_run_pagoda_samples_at_the_temperature_asked(llm, monkeypatch):
    added = []
    add = llm.engine.add_request
    monkeypatch.setattr(
        llm.engine,
        "add_request",
        lambda rid, ids, params: added.append(params) or add(rid, ids, params),
    )
    result = run_pagoda(llm, [[1] * 4, [2] * 4], [5, 5], [], temperature=0.8)
    assert result["output_tokens"] == 10
    assert [p.temperature for p in added] == [0.8, 0.8] and not added[0].greedy


def test_decode_vs_floor_weighs_each_step_by_its_own_bytes(llm):
    steps = [DecodeStep(0.002, 1, 100), DecodeStep(0.004, 2, 1000)]
    bandwidth = 1e9
    floors = [
        (weight_bytes(llm, s.batch) + s.context * kv_bytes_per_token(llm)) / bandwidth
        for s in steps
    ]
    got = decode_vs_floor(llm, steps, bandwidth)
    assert got["steps"] == 2
    assert got["ratio_total"] == pytest.approx(0.006 / sum(floors))
    assert got["ratio_p50"] == pytest.approx((0.002 / floors[0] + 0.004 / floors[1]) / 2)
    assert floors[1] > floors[0] > 0
    assert decode_vs_floor(llm, [], bandwidth) == {"steps": 0}


def test_llama3_8b_shape_has_8b_parameters():
    from benchmarks.shapes import CONFIGS, ON_DEVICE
    from engine.models.llama import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(CONFIGS["llama3-8b"]())
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    assert "llama3-8b" in ON_DEVICE  # 16 GB: drawn on the device, not written to disk


def test_llama4_scout_shape_has_its_parameters():
    """Scout's language model: 107.8B parameters, 17.2B active (its 16 experts, top-1)."""
    from benchmarks.shapes import CONFIGS, ON_DEVICE
    from engine.models.loader import build_on_meta

    model = build_on_meta(CONFIGS["llama4-scout"]())
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if n.endswith((".w13", ".w2")))
    assert total == 107_769_870_336
    assert round((total - experts * 15 / 16) / 1e9, 1) == 17.2
    assert "llama4-scout" in ON_DEVICE


def test_static_cache_generate_streams_every_token(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    model.generation_config.eos_token_id = None
    input_ids = torch.tensor([[1, 2, 3, 4]])
    streamer = TokenTimes()
    with torch.inference_mode():
        out = model.generate(input_ids, streamer=streamer, **static_generate_kwargs(input_ids, 5))
    assert out.shape == (1, 9)
    assert len(streamer.times) == 6  # the prompt, then each new token
    timing = per_token_ms(streamer.times)
    assert timing["new_tokens"] == 5 and timing["decode_ms_per_token"] > 0


def test_random_adapters_load_and_spread_over_the_requests(tiny_llama_dir):
    """benchmarks.offline --lora: the random adapters fit the checkpoint's shapes, and
    request i generates with adapter i mod N."""
    adapters = write_random_adapters(tiny_llama_dir, 2, 4)
    llm = LLM(tiny_llama_dir, device="cpu", max_num_seqs=4, lora_modules=adapters)
    assert llm.engine.model.lora_slots.state.rank == 4
    added = []
    add = llm.engine.add_request
    llm.engine.add_request = lambda rid, ids, params: added.append(params) or add(rid, ids, params)
    run_pagoda(llm, [[1] * 4] * 3, [3] * 3, [], loras=list(adapters))
    assert [p.lora_name for p in added] == ["lora0", "lora1", "lora0"]


@pytest.mark.parametrize(
    ("config", "moe"),
    [
        ({"num_local_experts": 8}, True),  # Mixtral, gpt-oss
        ({"n_routed_experts": 64}, True),  # DeepSeek, GLM-4.5
        ({"text_config": {"num_experts": 128}}, True),  # a multimodal model's MoE text model
        ({"num_experts": 0, "hidden_size": 64}, False),
        ({"hidden_size": 64}, False),
    ],
)
def test_routes_experts_reads_the_config(tmp_path, config, moe):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert routes_experts(str(tmp_path)) is moe


def test_an_moe_batch_of_one_repeated_prompt_is_refused(tmp_path, capsys):
    """Every sequence would route to the same experts: the run stops before loading."""
    (tmp_path / "config.json").write_text(json.dumps({"num_experts": 8}))
    with pytest.raises(SystemExit) as exc:
        main(["--model", str(tmp_path), "--num-requests", "4"])
    assert exc.value.code == 2 and "--input-len" in capsys.readouterr().err
