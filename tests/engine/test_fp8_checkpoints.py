"""FP8 checkpoints (transformers' FineGrainedFP8 and compressed-tensors layouts), built
here from a tiny random checkpoint, load to the same dequantized weights; unsupported
schemes fail naming themselves; per-channel ones requantize to their own bytes
(--quantization fp8 itself: test_fp8_quantize_model.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.llm import LLM
from engine.models.loader import ModelLoadError, load_config, load_model
from engine.models.quantization import checkpoint_fp8, quantize_model
from engine.sampling_params import SamplingParams
from kernels.fp8 import FP8_DTYPE, FP8_MAX, dequantize_fp8, quantize_fp8_ref
from tests.engine.test_fp8_quantize_model import prefill_logits

CPU = torch.device("cpu")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _is_projection(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS


def _quantize_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' layout: e4m3 weight, fp32 weight_scale_inv [ceil(N/bn), ceil(K/bk)]."""
    bn, bk = block
    n, k = w.shape
    rows, cols = -(-n // bn), -(-k // bk)
    scale = torch.empty(rows, cols)
    q = torch.empty(n, k, dtype=FP8_DTYPE)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].float()
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / FP8_MAX
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = quantize_fp8_ref(tile, scale[i, j])
    return q, scale


def _write_fp8(src: str, dst: Path, layout: str) -> dict[str, torch.Tensor]:
    """Save src's projections in `layout`; returns what each projection dequantizes to."""
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    tensors = load_file(str(Path(src) / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    block = (48, 48)  # 64 and 128 are not multiples: ragged edge blocks
    for name, w in tensors.items():
        if not _is_projection(name):
            out[name] = w
            continue
        prefix = name.removesuffix(".weight")
        if layout == "fp8-block":
            q, scale = _quantize_block(w, block)
            out[f"{prefix}.weight_scale_inv"] = scale
            full = scale.repeat_interleave(48, 0)[: w.shape[0]].repeat_interleave(48, 1)
            expected[name] = dequantize_fp8(q, full[:, : w.shape[1]])
        elif layout == "autofp8":  # AutoFP8's: quant_method fp8, per-tensor weight_scale
            scale = w.float().abs().max() / FP8_MAX  # a 0-d tensor
            q = quantize_fp8_ref(w, scale)
            out[f"{prefix}.weight_scale"] = scale
            out[f"{prefix}.input_scale"] = torch.tensor(0.1)  # static: dropped
            expected[name] = dequantize_fp8(q, scale)
        elif layout == "ct-channel":
            scale = w.float().abs().amax(dim=1, keepdim=True) / FP8_MAX  # [N, 1]
            q = quantize_fp8_ref(w, scale)
            out[f"{prefix}.weight_scale"] = scale
            out[f"{prefix}.input_scale"] = torch.tensor([0.1])  # static: dropped
            expected[name] = dequantize_fp8(q, scale)
        else:  # ct-tensor
            scale = (w.float().abs().max() / FP8_MAX).reshape(1)
            q = quantize_fp8_ref(w, scale)
            out[f"{prefix}.weight_scale"] = scale
            expected[name] = dequantize_fp8(q, scale)
        out[name] = q
    # K/V cache scales, as compressed-tensors and vLLM name them.
    out["model.layers.1.self_attn.k_scale"] = torch.tensor(0.25)
    out["model.layers.1.self_attn.v_scale"] = torch.tensor(0.5)
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = QUANT_CONFIGS[layout]
    (dst / "config.json").write_text(json.dumps(config))
    return expected


def _ct_config(strategy: str) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor"},
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"},
    }


QUANT_CONFIGS = {
    "fp8-block": {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [48, 48],
    },
    "autofp8": {"quant_method": "fp8", "activation_scheme": "static"},
    "ct-channel": _ct_config("channel"),
    "ct-tensor": _ct_config("tensor"),
}


@pytest.fixture(scope="module", params=list(QUANT_CONFIGS))
def fp8_checkpoint(request, tiny_llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "model"
    return request.param, str(path), _write_fp8(tiny_llama_dir, path, request.param)


def _projection_weights(model) -> dict[str, torch.Tensor]:
    """Our fused qkv/gate_up parameters, split back into HF's names."""
    out = {}
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        prefix = f"model.layers.{i}"
        q, k, v = attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])
        gate, up = mlp.gate_up_proj.weight.chunk(2)
        parts = dict(q_proj=q, k_proj=k, v_proj=v, gate_proj=gate, up_proj=up)
        for proj, w in parts.items():
            kind = "self_attn" if proj[0] in "qkv" else "mlp"
            out[f"{prefix}.{kind}.{proj}.weight"] = w
        out[f"{prefix}.self_attn.o_proj.weight"] = attn.o_proj.weight
        out[f"{prefix}.mlp.down_proj.weight"] = mlp.down_proj.weight
    return out


def test_fp8_checkpoint_loads_to_its_dequantized_weights(fp8_checkpoint, tiny_llama_dir):
    layout, path, expected = fp8_checkpoint
    model, _ = load_model(path, CPU, torch.float32)  # CPU: served dequantized, in fp32
    original, _ = load_model(tiny_llama_dir, CPU, torch.float32)
    loaded = _projection_weights(model)
    reference = _projection_weights(original)
    assert set(loaded) == set(expected)
    for name, want in expected.items():
        assert torch.equal(loaded[name], want), name  # exactly q * scale
        # ... which is the original within e4m3's rounding.
        w = reference[name]
        # (a block's own maximum, which bounds its error, is at most the tensor's)
        assert (loaded[name] - w).abs().max() <= w.abs().max() / 28, name
    # Everything else is the original's.
    assert torch.equal(model.embed_tokens.weight, original.embed_tokens.weight)
    assert torch.equal(model.lm_head.weight, original.lm_head.weight)
    attn = [layer.self_attn.attn for layer in model.layers]
    assert [(a.k_scale, a.v_scale) for a in attn] == [(1.0, 1.0), (0.25, 0.5)]


def test_fp8_checkpoint_generates_like_its_dequantized_weights(tmp_path, tiny_llama_dir):
    """End to end on CPU: the FP8 checkpoint's greedy output equals that of a plain
    checkpoint holding the dequantized weights."""
    fp8_dir = tmp_path / "fp8"
    expected = _write_fp8(tiny_llama_dir, fp8_dir, "ct-channel")
    plain_dir = tmp_path / "plain"
    shutil.copytree(tiny_llama_dir, plain_dir)
    tensors = load_file(str(plain_dir / "model.safetensors"))
    tensors.update(expected)
    save_file(tensors, str(plain_dir / "model.safetensors"))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 13, 2], [7, 7, 1]]
    outs = []
    for d in (fp8_dir, plain_dir):
        llm = LLM(str(d), device="cpu")
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert outs[0] == outs[1]


def _with_quant_config(src: str, dst: Path, quant: dict) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


@pytest.mark.parametrize(
    ("quant", "named"),
    [
        ({"quant_method": "awq", "bits": 4}, "'awq'"),
        ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}},
            },
            "'pack-quantized'",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {
                    "g": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}
                },
            },
            "8-bit int weights",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {
                    "g": {"weights": {"num_bits": 8, "type": "float", "strategy": "group"}}
                },
            },
            "strategy group",
        ),
        ({"quant_method": "fp8", "scale_fmt": "ue8m0"}, "'ue8m0'"),
    ],
)
def test_unsupported_scheme_is_a_clear_load_error(quant, named, tiny_llama_dir, tmp_path):
    path = _with_quant_config(tiny_llama_dir, tmp_path / "m", quant)
    with pytest.raises(ModelLoadError, match="config.json") as exc:
        load_config(path)
    assert named in str(exc.value)
    assert "unsupported" in str(exc.value)


def test_fp8_weight_without_its_scale_is_a_load_error(tiny_llama_dir, tmp_path):
    dst = tmp_path / "m"
    _write_fp8(tiny_llama_dir, dst, "ct-channel")
    tensors = load_file(str(dst / "model.safetensors"))
    del tensors["model.layers.0.mlp.up_proj.weight_scale"]
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="up_proj"):
        load_model(str(dst), CPU, torch.float32)


def test_fp8_moe_keeps_a_checkpoints_expert_bytes_and_its_logits(tiny_family_dir, tmp_path):
    """A per-channel FP8 MoE checkpoint: its experts dequantize into bf16 and quantize
    again to the same e4m3 bytes, each (expert, row) its own scale; and the FP8 model's
    logits stay near the bf16 one's."""
    dst = tmp_path / "m"
    _write_fp8(tiny_family_dir("qwen3_moe"), dst, "ct-channel")
    model, _ = load_model(str(dst), CPU, torch.bfloat16)
    ids = [5, 9, 13, 2, 7, 7, 1, 30, 4]
    before = prefill_logits(model, ids).float()
    quantize_model(model)
    tensors = load_file(str(dst / "model.safetensors"))
    moe, inter = model.layers[0].mlp, model.layers[0].mlp.inter.local_size
    for expert in (0, 5):
        prefix = f"model.layers.0.mlp.experts.{expert}"
        for rows, proj in ((slice(0, inter), "gate_proj"), (slice(inter, None), "up_proj")):
            want = tensors[f"{prefix}.{proj}.weight"]
            assert torch.equal(moe.w13[expert, rows].view(torch.uint8), want.view(torch.uint8))
            scale = tensors[f"{prefix}.{proj}.weight_scale"][:, 0]
            torch.testing.assert_close(moe.w13_scale[expert, rows], scale, rtol=2**-8, atol=0)
        want = tensors[f"{prefix}.down_proj.weight"]
        assert torch.equal(moe.w2[expert].view(torch.uint8), want.view(torch.uint8))
    after = prefill_logits(model, ids).float()
    assert torch.nn.functional.cosine_similarity(before, after, dim=-1).min() > 0.99


def test_checkpoint_fp8_reads_the_layouts(tiny_llama_dir):
    class Config:
        quantization_config = QUANT_CONFIGS["fp8-block"]

    scheme = checkpoint_fp8(Config())
    assert scheme.scale_names[0] == "weight_scale_inv" and scheme.block_size == (48, 48)
    Config.quantization_config = QUANT_CONFIGS["ct-tensor"]
    assert checkpoint_fp8(Config()).scale_names == ("weight_scale",)
    assert checkpoint_fp8(load_config(tiny_llama_dir)) is None


def test_per_channel_checkpoint_requantizes_to_its_own_bytes(tiny_llama_dir, tmp_path):
    """What CUDA does with a per-channel FP8 checkpoint: dequantize into bf16, quantize
    per channel again. bf16's rounding of q * scale (2**-9 relative) is far below
    e4m3's step (>= 2**-4), so every fp8 value comes back the same."""
    dst = tmp_path / "m"
    _write_fp8(tiny_llama_dir, dst, "ct-channel")
    model, _ = load_model(str(dst), CPU, torch.bfloat16)
    quantize_model(model)
    tensors = load_file(str(dst / "model.safetensors"))
    attn = model.layers[1].self_attn
    q_rows = attn.qkv_proj.weight[: attn.q_size]
    want = tensors["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(q_rows.view(torch.uint8), want.view(torch.uint8))
    down = tensors["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(
        model.layers[1].mlp.down_proj.weight.view(torch.uint8), down.view(torch.uint8)
    )
    scale = tensors["model.layers.1.mlp.down_proj.weight_scale"][:, 0]
    torch.testing.assert_close(
        model.layers[1].mlp.down_proj.weight_scale, scale, rtol=2**-8, atol=0
    )
