"""FP8 checkpoints (transformers' FineGrainedFP8 and compressed-tensors layouts), built
here from a tiny random checkpoint, load to the same dequantized weights; unsupported
schemes fail naming themselves; --quantization fp8 swaps the dense projections."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.llm import LLM
from engine.models.layers import AttentionMetadata, AttentionOps, PagedAttention
from engine.models.loader import ModelLoadError, load_config, load_model
from engine.models.quantization import Fp8Linear, checkpoint_fp8, quantize_model
from engine.sampling_params import SamplingParams
from kernels.fp8 import FP8_DTYPE, FP8_MAX, dequantize_fp8, fp8_linear_ref, quantize_fp8_ref

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


def test_quantize_model_swaps_dense_projections_only(tiny_llama_dir, tiny_family_dir):
    model, _ = load_model(tiny_llama_dir, CPU, torch.float32)
    assert quantize_model(model) == 2 * 4  # qkv, o, gate_up, down per layer
    layer = model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert isinstance(linear, Fp8Linear) and linear.weight.dtype == FP8_DTYPE
    assert model.lm_head.weight.dtype == torch.float32  # head and embeddings stay
    assert next(model.parameters()).dtype == torch.float32  # fp8 lives in buffers
    # MoE: the router stays; the experts, the dense layer's MLP and attention go FP8.
    moe, _ = load_model(tiny_family_dir("qwen3_moe"), CPU, torch.float32)
    assert quantize_model(moe) == 2 * 2 + 2 + 2
    experts = moe.layers[0].mlp
    assert not isinstance(experts.gate, Fp8Linear)
    assert experts.w13.dtype == experts.w2.dtype == FP8_DTYPE
    assert experts.w13_scale.shape == experts.w13.shape[:2]
    assert next(moe.parameters()).dtype == torch.float32


def test_fp8_moe_keeps_a_checkpoints_expert_bytes_and_its_logits(tiny_family_dir, tmp_path):
    """A per-channel FP8 MoE checkpoint: its experts dequantize into bf16 and quantize
    again to the same e4m3 bytes, each (expert, row) its own scale; and the FP8 model's
    logits stay near the bf16 one's."""
    dst = tmp_path / "m"
    _write_fp8(tiny_family_dir("qwen3_moe"), dst, "ct-channel")
    model, _ = load_model(str(dst), CPU, torch.bfloat16)
    ids = [5, 9, 13, 2, 7, 7, 1, 30, 4]
    before = _prefill_logits(model, ids).float()
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
    after = _prefill_logits(model, ids).float()
    assert torch.nn.functional.cosine_similarity(before, after, dim=-1).min() > 0.99


def _prefill_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """One sequence's logits at every position: an eager prefill through fresh caches."""
    n, block = len(ids), 16
    blocks = -(-n // block)
    for layer in (m for m in model.modules() if isinstance(m, PagedAttention)):
        shape = (blocks, block, layer.num_kv_heads, layer.head_dim)
        layer.k_cache, layer.v_cache = torch.zeros(shape), torch.zeros(shape)
        layer.ops = AttentionOps.for_device(CPU)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        block_table=torch.arange(blocks, dtype=torch.int32)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        max_query_len=n,
        is_decode=False,
    )
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), meta))


# kind -> (module names quantize_model makes quantize their output, some it must not)
FP8_PRODUCERS = {
    "llama": (
        ["layers.0.input_layernorm", "layers.0.post_attention_layernorm", "layers.0.mlp"],
        ["norm"],
    ),
    # The norm after attention feeds the residual stream, the one before the MLP gate_up.
    "gemma3": (
        ["layers.1.input_layernorm", "layers.1.pre_feedforward_layernorm", "layers.1.mlp"],
        ["layers.1.post_attention_layernorm", "layers.1.post_feedforward_layernorm"],
    ),
    # Layer 0's MLP is the MoE block (router and experts stay), layer 1's dense.
    "qwen3_moe": (
        ["layers.0.input_layernorm", "layers.1.post_attention_layernorm", "layers.1.mlp"],
        ["layers.0.post_attention_layernorm"],
    ),
    "gpt2": (["h.0.ln_1", "h.0.ln_2"], ["ln_f"]),
    "gpt_neox": (["layers.0.input_layernorm", "layers.0.post_attention_layernorm"], ["norm"]),
    # Phi's one norm feeds attention and MLP: each projection quantizes its own input.
    "phi": ([], ["layers.0.input_layernorm", "norm"]),
    # MLA's norm feeds q_proj and kv_a_proj_with_mqa, both FP8; its latent's norm feeds
    # the cache. Layer 0 is dense, layer 1 MoE.
    "deepseek_v2": (
        ["layers.0.input_layernorm", "layers.1.input_layernorm", "layers.0.mlp"],
        ["layers.1.post_attention_layernorm", "layers.0.self_attn.kv_a_layernorm"],
    ),
    # Here kv_a_proj_with_mqa's 40 rows and q_b_proj's 24 columns are no FP8 shapes.
    "deepseek_v3": (
        ["layers.0.post_attention_layernorm", "layers.0.mlp"],
        ["layers.0.input_layernorm", "layers.0.self_attn.q_a_layernorm"],
    ),
}


@pytest.mark.parametrize("kind", list(FP8_PRODUCERS))
def test_norms_and_activations_quantize_for_their_fp8_projections(
    kind, tiny_llama_dir, tiny_gpt2_dir, tiny_family_dir
):
    """quantize_model has each norm or activation whose only reader went FP8 quantize
    its own output (one launch fewer on CUDA), and nothing else: the logits equal those
    with every projection quantizing its input itself."""
    path = {"llama": tiny_llama_dir, "gpt2": tiny_gpt2_dir}.get(kind) or tiny_family_dir(kind)
    model, _ = load_model(path, CPU, torch.float32)
    quantize_model(model)
    modules = dict(model.named_modules())
    fused, plain = FP8_PRODUCERS[kind]
    assert all(modules[name].fp8_out for name in fused)
    assert not any(modules[name].fp8_out for name in plain)
    ids = [5, 9, 13, 2, 7, 7, 1, 30, 4]
    got = _prefill_logits(model, ids)
    for module in model.modules():
        if hasattr(module, "fp8_out"):
            module.fp8_out = False
    assert torch.equal(got, _prefill_logits(model, ids))


def test_a_producer_of_several_consumers_quantizes_only_if_all_went_fp8():
    """FP8_FEEDS naming a tuple (MLA's norm feeds q and kv_a): the producer quantizes its
    rows only when every consumer reads e4m3 rows."""

    class Block(torch.nn.Module):
        FP8_FEEDS = {"norm": ("first", "second")}

        def __init__(self, second_rows: int) -> None:
            super().__init__()
            self.norm = torch.nn.LayerNorm(32)
            self.norm.fp8_out = False
            self.first = torch.nn.Linear(32, 32)
            self.second = torch.nn.Linear(32, second_rows)  # 24 rows: no _scaled_mm shape

    both, one = Block(48), Block(24)
    assert quantize_model(both) == 2 and both.norm.fp8_out
    assert quantize_model(one) == 1 and isinstance(one.first, Fp8Linear)
    assert not one.norm.fp8_out


def test_fp8_linear_module_matches_reference_and_linear():
    rng = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    fp8 = Fp8Linear.from_linear(linear)
    x = torch.randn(3, 5, 64, generator=rng)
    out = fp8(x)
    assert out.shape == (3, 5, 48)
    want = fp8_linear_ref(x.view(-1, 64), fp8.weight, fp8.weight_scale, fp8.bias)
    assert torch.equal(out.view(-1, 48), want)
    exact = linear(x).detach()
    assert (out - exact).norm() / exact.norm() < 0.05


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


def _quantized_both_ways(model_dir: str, monkeypatch) -> tuple[dict, dict]:
    """The state of `model_dir` loaded with --quantization fp8 (each projection's rows
    quantized as they are read), and loaded in bf16 then quantized."""
    import engine.models.loader as loader

    monkeypatch.setattr(loader, "check_fp8_device", lambda device: None)  # FP8 is CUDA's
    streamed, _ = load_model(model_dir, CPU, torch.bfloat16, quantization="fp8")
    after, _ = load_model(model_dir, CPU, torch.bfloat16)
    quantize_model(after)
    return streamed.state_dict(), after.state_dict()


def _assert_same_bytes(got: dict, want: dict, scaled: tuple[str, ...] = ()) -> None:
    """Every tensor equal, e4m3 ones byte for byte; those named by `scaled` (a multiplier
    applied after loading: to the weights before quantizing, or to the scales after) to
    within e4m3's rounding, dequantized."""
    assert got.keys() == want.keys()
    quantized = [k for k, t in got.items() if t.dtype == FP8_DTYPE]
    assert quantized and all(want[k].dtype == FP8_DTYPE for k in quantized)
    for key, tensor in got.items():
        if key.endswith(scaled) or key.removesuffix("_scale").endswith(scaled):
            if tensor.dtype == FP8_DTYPE:
                deq = tensor.float() * got[f"{key}_scale"][..., None]
                want_deq = want[key].float() * want[f"{key}_scale"][..., None]
                torch.testing.assert_close(deq, want_deq, rtol=0.07, atol=1e-6)
            continue
        if tensor.dtype == FP8_DTYPE:
            assert torch.equal(tensor.view(torch.uint8), want[key].view(torch.uint8)), key
        else:
            assert torch.equal(tensor, want[key]), key


# glm4 and phi3: partial rotary, q/k rows reordered after loading; deepseek_v2: q's and
# k_pe's rows reordered (rotary pairs de-interleaved); gpt2: Conv1D weights read
# transposed; granite: the residual multiplier on o_proj and down_proj (on w2 for
# granitemoe's experts).
@pytest.mark.parametrize(
    "kind",
    [
        "llama",
        "gpt2",
        "glm4",
        "phi3",
        "granite",
        "deepseek_v2",
        "deepseek_v3",
        "qwen3_moe",
        "gpt_oss",
        "granitemoe",
    ],
)
def test_quantized_as_they_load_equal_quantized_after(kind, tiny_family_dir, request, monkeypatch):
    """--quantization fp8 from a checkpoint: each projection's and expert's rows go to
    e4m3 as they are read (never held in the model dtype), to the bytes and scales that
    quantizing the loaded model gives."""
    if kind in ("llama", "gpt2"):
        model_dir = request.getfixturevalue(f"tiny_{kind}_dir")
    else:
        model_dir = tiny_family_dir(kind)
    got, want = _quantized_both_ways(model_dir, monkeypatch)
    scaled = ("o_proj.weight", "down_proj.weight", "w2") if kind.startswith("granite") else ()
    _assert_same_bytes(got, want, scaled)


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_random_weights_quantized_as_drawn_equal_quantized_after(
    kind, tiny_family_dir, tiny_llama_dir, tmp_path, monkeypatch
):
    """A benchmark's random-weight checkpoint under --quantization fp8: each drawn chunk
    quantized as it is drawn, the bytes of the bf16 model's weights quantized."""
    from engine.models.loader import RANDOM_WEIGHTS_MARKER

    source = Path(tiny_llama_dir if kind == "llama" else tiny_family_dir(kind))
    model_dir = tmp_path / kind
    shutil.copytree(source, model_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    (model_dir / RANDOM_WEIGHTS_MARKER).write_text("")
    got, want = _quantized_both_ways(str(model_dir), monkeypatch)
    _assert_same_bytes(got, want)
