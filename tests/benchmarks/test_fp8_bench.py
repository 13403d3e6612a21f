"""benchmarks.fp8's CPU-checkable parts: the logits it compares are the engine's own,
FP8 weights count at their size, and the summary's ratios."""

from __future__ import annotations

import torch

from benchmarks.fp8 import (
    CONFIGS,
    compare_logits,
    last_logits,
    reference_forward,
    summary,
    weight_bytes,
)
from engine import LLM, SamplingParams
from engine.models.quantization import Fp8Linear, quantize_model


def test_last_logits_are_what_the_engine_samples_from(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cpu", enable_prefix_caching=False)
    prompts = [list(range(3, 40)), [5, 6, 7]]
    logits = last_logits(llm, prompts)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert logits.argmax(-1).tolist() == [o.outputs[0].token_ids[0] for o in outs]
    same = compare_logits(logits, logits)
    assert same["top1_agreement"] == 1.0 and abs(same["cosine_min"] - 1) < 1e-6
    # FP8 projections: one byte per weight plus a 4-byte scale per row.
    full = weight_bytes(llm.engine.model)
    quantize_model(llm.engine.model)
    layer = llm.engine.model.layers[0]
    linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj]
    linears.append(layer.mlp.down_proj)
    saved = sum(m.weight.numel() * 3 - 4 * m.out_features for m in linears) * 2  # 2 layers
    assert weight_bytes(llm.engine.model) == full - saved
    flipped = compare_logits(-logits, logits)
    assert flipped["cosine_mean"] < 0 and flipped["top1_agreement"] == 0.0


def test_summary_ratios():
    configs = {
        "bf16": {
            "kv_blocks": 100,
            "batch1": {"ms_per_token": 7.0},
            "throughput": {"tok_per_s": 1000.0},
        },
        "fp8": {
            "kv_blocks": 400,
            "batch1": {"ms_per_token": 3.5, "weights_only_floor_ms": 2.7},
            "throughput": {"tok_per_s": 1700.0},
            "logits_vs_bf16": {"cosine_mean": 0.99},
        },
        "bf16+fp8kv": {"kv_blocks": 200, "logits_vs_bf16": {"cosine_mean": 0.999}},
        "fp8+bf16kv": {"kv_blocks": 200, "logits_vs_bf16": {"cosine_mean": 0.995}},
        "fp8 reference": {
            "kv_blocks": 200,
            "logits_vs_bf16": {"cosine_mean": 0.994},
            "logits_vs_engine": {"cosine_mean": 0.9999},
        },
    }
    out = summary(configs)
    assert out["throughput_tok_s"]["ratio"] == 1.7
    assert out["kv_blocks_bf16 weights"]["ratio"] == 2.0
    assert out["kv_blocks_fp8 weights"]["ratio"] == 2.0
    assert set(out["logits_vs_bf16"]) == {"fp8", "bf16+fp8kv", "fp8+bf16kv", "fp8 reference"}
    assert out["fp8_engine_vs_reference"] == {"cosine_mean": 0.9999}
    assert torch.isclose(torch.tensor(out["batch1_ms_per_token"]["fp8"]), torch.tensor(3.5))
    # FP8 alone (a 70B, whose bf16 weights no single GPU holds): its own figures only.
    alone = summary({"fp8": {k: v for k, v in configs["fp8"].items() if k != "logits_vs_bf16"}})
    assert alone["throughput_tok_s"] == {"fp8": 1700.0}
    assert alone["batch1_ms_per_token"] == {"fp8": 3.5, "fp8_weights_only_floor": 2.7}
    assert alone["logits_vs_bf16"] == {}


def test_reference_forward_is_the_schemes_torch_reference():
    """The "fp8 reference" run's projections: x quantized per token, both sides
    dequantized, one fp32 matmul, whatever the input's leading dims; and it runs after
    the engine's FP8 run it is compared with."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, dtype=torch.bfloat16)
    fp8 = Fp8Linear.from_linear(linear)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    got = reference_forward(fp8, x)
    assert got.shape == (2, 3, 48) and got.dtype == torch.bfloat16
    amax = x.float().abs().amax(-1, keepdim=True) / 448
    x_q = (x.float() / amax).to(torch.float8_e4m3fn).float() * amax
    w = fp8.weight.float() * fp8.weight_scale[:, None]
    want = (x_q @ w.t() + linear.bias.float()).to(torch.bfloat16)
    assert torch.equal(got, want)
    assert not torch.equal(got, linear(x))  # the quantization shows
    names = list(CONFIGS)
    assert names.index("fp8+bf16kv") < names.index("fp8 reference")
    assert CONFIGS["fp8 reference"].reference and not CONFIGS["fp8+bf16kv"].reference
