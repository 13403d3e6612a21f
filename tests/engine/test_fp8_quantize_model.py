"""--quantization fp8 on a checkpoint in the model dtype: which modules go FP8 (the dense
projections and experts; norms and activations quantizing for them), and the bytes of
projections quantized as they load, equal to those of the loaded model quantized after."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from engine.models.layers import AttentionMetadata, AttentionOps, PagedAttention
from engine.models.loader import load_model
from engine.models.quantization import Fp8Linear, quantize_model
from kernels.fp8 import FP8_DTYPE, fp8_linear_ref

CPU = torch.device("cpu")


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


def prefill_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
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
    got = prefill_logits(model, ids)
    for module in model.modules():
        if hasattr(module, "fp8_out"):
            module.fp8_out = False
    assert torch.equal(got, prefill_logits(model, ids))


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
