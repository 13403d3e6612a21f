"""GPT-OSS checkpoints: the stacked, interleaved expert tensors, and OpenAI's MXFP4
experts dequantized at load as transformers dequantizes them. (Token-for-token agreement
of the plain checkpoint with transformers is in test_models_exactness.py.)"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from engine import LLM, SamplingParams
from engine.models.loader import ModelLoadError, load_config, load_model, load_tokenizer
from engine.models.quantization import dequantize_mxfp4
from tests.reference import PROMPTS, hf_greedy

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def plain_dir(tiny_family_dir) -> str:
    return tiny_family_dir("gpt_oss")


@pytest.fixture(scope="module")
def mxfp4_dirs(plain_dir, tmp_path_factory) -> tuple[str, str]:
    """The tiny GPT-OSS with random MXFP4 experts (the scales in a second shard: a
    tensor's blocks and scales need not share a file, so the loader holds one until
    the other comes), and the same model with those experts dequantized by
    transformers' own function, saved plain."""
    packed = shutil.copytree(plain_dir, tmp_path_factory.mktemp("gpt-oss") / "mxfp4")
    dequantized = shutil.copytree(plain_dir, tmp_path_factory.mktemp("gpt-oss") / "plain")
    weights = load_file(packed / "model.safetensors")
    plain = dict(weights)
    rng = torch.Generator().manual_seed(0)
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, cols, rows = weights.pop(name).shape  # [experts, in, out]
        blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=rng)
        scales = torch.randint(122, 129, (experts, rows, cols // 32), generator=rng)
        weights[f"{name}_blocks"], weights[f"{name}_scales"] = blocks.byte(), scales.byte()
        plain[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    (packed / "model.safetensors").unlink()
    shards: dict[str, dict[str, torch.Tensor]] = {"model-00001.safetensors": {}}
    shards["model-00002.safetensors"] = {}
    for name, tensor in weights.items():
        shards[f"model-0000{1 + name.endswith('_scales')}.safetensors"][name] = tensor
    for shard, tensors in shards.items():
        save_file(tensors, packed / shard, metadata={"format": "pt"})
    weight_map = {name: shard for shard, tensors in shards.items() for name in tensors}
    (packed / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    save_file(plain, dequantized / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (packed / "config.json").write_text(json.dumps(config))
    return str(packed), str(dequantized)


def test_interleaved_gate_up_becomes_gate_rows_then_up_rows(plain_dir):
    model, _ = load_model(plain_dir, CPU, torch.float32)
    hf = load_file(f"{plain_dir}/model.safetensors")
    moe, prefix = model.layers[1].mlp, "model.layers.1.mlp"
    gate_up, bias = hf[f"{prefix}.experts.gate_up_proj"], hf[f"{prefix}.experts.gate_up_proj_bias"]
    for e in range(4):
        want = torch.cat([gate_up[e][:, 0::2].t(), gate_up[e][:, 1::2].t()])
        torch.testing.assert_close(moe.w13[e], want, rtol=0, atol=0)
        torch.testing.assert_close(moe.b13[e], torch.cat([bias[e][0::2], bias[e][1::2]]))
        torch.testing.assert_close(moe.w2[e], hf[f"{prefix}.experts.down_proj"][e].t())
    torch.testing.assert_close(moe.b2, hf[f"{prefix}.experts.down_proj_bias"])
    torch.testing.assert_close(moe.gate.bias, hf[f"{prefix}.router.bias"])
    sinks = model.layers[0].self_attn.sinks
    torch.testing.assert_close(sinks, hf["model.layers.0.self_attn.sinks"])


def test_dequantize_mxfp4_decodes_nibbles_and_scales():
    # 0x2F: low nibble 0xF (-6.0), high 0x2 (1.0); scale 128: times 2; 125: times 1/4.
    blocks = torch.tensor([[[0x2F] + [0] * 15], [[0x70] + [0] * 15]], dtype=torch.uint8)
    values = dequantize_mxfp4(blocks, torch.tensor([[128], [125]], dtype=torch.uint8))
    assert values.shape == (2, 32)
    assert values[0, :3].tolist() == [-12.0, 2.0, 0.0]
    assert values[1, :2].tolist() == [0.0, 1.5]


def test_mxfp4_experts_load_as_transformers_dequantizes_them(mxfp4_dirs):
    packed, dequantized = mxfp4_dirs
    want, _ = load_model(dequantized, CPU, torch.float32)
    got, _ = load_model(packed, CPU, torch.float32)
    for name, param in want.named_parameters():
        torch.testing.assert_close(dict(got.named_parameters())[name], param, rtol=0, atol=0)


def test_mxfp4_model_generates_what_transformers_does(mxfp4_dirs):
    packed, dequantized = mxfp4_dirs
    tokenizer = load_tokenizer(packed)
    want = [hf_greedy(dequantized, tokenizer.encode(p), 12) for p in PROMPTS[:3]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = LLM(packed, device="cpu").generate(PROMPTS[:3], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_mxfp4_elsewhere_is_refused(tmp_path, tiny_family_dir):
    model_dir = shutil.copytree(tiny_family_dir("mixtral"), tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported quantization scheme.*'mxfp4'"):
        load_config(str(model_dir))
