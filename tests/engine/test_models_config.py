"""Loading the newer families: stacked expert weights, per-layer windows and rope bases,
LongRoPE's and YaRN's tables, and clear errors for config features Pagoda does not
implement."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM
from engine.models.layers import PagedAttention
from engine.models.loader import ModelLoadError, load_config, load_model, max_model_len
from engine.models.rope import RotaryEmbedding, longrope_cos_sin, rope_settings


def edited_copy(src: str, dst, **changes) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def test_experts_are_stacked_from_per_expert_tensors(tiny_family_dir):
    model_dir = tiny_family_dir("mixtral")
    model, _ = load_model(model_dir, torch.device("cpu"), torch.float32)
    hf = load_file(f"{model_dir}/model.safetensors")
    moe = model.layers[1].mlp
    prefix = "model.layers.1.block_sparse_moe"
    for e in range(4):
        gate, up = hf[f"{prefix}.experts.{e}.w1.weight"], hf[f"{prefix}.experts.{e}.w3.weight"]
        torch.testing.assert_close(moe.w13[e], torch.cat([gate, up]), rtol=0, atol=0)
        torch.testing.assert_close(moe.w2[e], hf[f"{prefix}.experts.{e}.w2.weight"], rtol=0, atol=0)
    torch.testing.assert_close(moe.gate.weight, hf[f"{prefix}.gate.weight"], rtol=0, atol=0)


def test_a_missing_expert_is_named(tmp_path, tiny_family_dir):
    model_dir = shutil.copytree(tiny_family_dir("qwen3_moe"), tmp_path / "m")
    weights = load_file(model_dir / "model.safetensors")
    del weights["model.layers.0.mlp.experts.5.up_proj.weight"]
    save_file(weights, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing.*layers\.0\.mlp\.w13"):
        load_model(str(model_dir), torch.device("cpu"), torch.float32)


# Each family's multi-token-prediction tensors as its checkpoints name them: one more
# `layers.N` (N = num_hidden_layers) for GLM-4.5 and DeepSeek-V3, `mtp*` modules for
# ERNIE 4.5 and EXAONE MoE.
DRAFT_WEIGHTS = {
    "glm4_moe": ["model.layers.2.eh_proj.weight", "model.layers.2.mlp.experts.0.up_proj.weight"],
    "deepseek_v3": ["model.layers.2.enorm.weight", "model.layers.2.self_attn.q_a_proj.weight"],
    "ernie4_5_moe": [
        "model.mtp_block.0.self_attn.q_proj.weight",
        "model.mtp_emb_norm.0.weight",
        "model.mtp_linear_proj.0.weight",
    ],
    "exaone_moe": ["mtp.fc.weight", "mtp.layers.0.self_attn.q_proj.weight"],
}


@pytest.mark.parametrize("kind", list(DRAFT_WEIGHTS))
def test_multi_token_prediction_weights_are_left_out(tmp_path, tiny_family_dir, kind):
    """The weights load without the draft modules, to the same parameters; a tensor the
    model does not know is still refused."""
    model_dir = shutil.copytree(tiny_family_dir(kind), tmp_path / "m")
    weights = load_file(model_dir / "model.safetensors")
    extra = {name: torch.zeros(8, 8) for name in DRAFT_WEIGHTS[kind]}
    save_file(weights | extra, model_dir / "model.safetensors")
    model, _ = load_model(str(model_dir), torch.device("cpu"), torch.float32)
    want, _ = load_model(tiny_family_dir(kind), torch.device("cpu"), torch.float32)
    assert len(model.layers) == 2
    for (name, param), (_, wanted) in zip(model.named_parameters(), want.named_parameters()):
        torch.testing.assert_close(param, wanted, rtol=0, atol=0, msg=name)
    save_file(
        weights | {"model.layers.1.eh_proj.weight": torch.zeros(8, 8)},
        model_dir / "model.safetensors",
    )
    with pytest.raises(ModelLoadError, match="eh_proj"):
        load_model(str(model_dir), torch.device("cpu"), torch.float32)


def test_windows_and_rope_bases_per_layer(tiny_family_dir):
    gemma, _ = load_model(tiny_family_dir("gemma3"), torch.device("cpu"), torch.float32)
    local, full = (layer.self_attn for layer in gemma.layers)
    assert (local.attn.sliding_window, full.attn.sliding_window) == (8, 0)
    assert (local.rotary.theta, full.rotary.theta) == (10000.0, 1e6)
    assert full.rotary.scaling["rope_type"] == "linear"
    qwen3, _ = load_model(tiny_family_dir("qwen3"), torch.device("cpu"), torch.float32)
    windows = [m.sliding_window for m in qwen3.modules() if isinstance(m, PagedAttention)]
    assert windows == [0, 10]  # use_sliding_window from max_window_layers (1) on


def test_gemma4_global_layers_have_heads_and_a_cache_of_their_own(tiny_family_dir):
    llm = LLM(tiny_family_dir("gemma4"), device="cpu", dtype="float32", num_kv_blocks=8)
    runner = llm.engine.runner
    local, full = runner.attn_layers
    assert (local.head_dim, local.num_kv_heads, full.head_dim, full.num_kv_heads) == (16, 2, 32, 2)
    assert local.k_cache.shape[2:] == (2, 16) and full.v_cache.shape[2:] == (2, 32)
    assert full.k_cache is not full.v_cache  # V is K's projection, stored apart once normed
    rotary = runner.model.rotary_global
    assert (rotary.rotary_dim, rotary.theta) == (32, 1e6)  # the whole head, 4 of 16 pairs turn
    assert (rotary.cos_sin[:, 4:16] == 1.0).all() and (rotary.cos_sin[:, 20:] == 0.0).all()
    assert (rotary.cos_sin[1:, 16:20] != 0.0).all()  # the 4 that turn: their sines
    per_token = (2 * 2 * 16 + 2 * 2 * 32) * 4  # K and V, each layer's own shape, fp32
    assert runner.bytes_per_block() == per_token * runner.block_size


def test_sliding_window_no_longer_caps_the_context(tiny_family_dir):
    config = load_config(tiny_family_dir("mistral"))
    assert config.sliding_window == 12
    assert max_model_len(config) == config.max_position_embeddings


def test_longrope_tables_match_transformers(tiny_family_dir):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_family_dir("phi3")  # rotates 12 of its 16 dims a head
    config = load_config(model_dir)
    original = config.rope_parameters["original_max_position_embeddings"]
    ours = longrope_cos_sin(12, config.max_position_embeddings, 10000.0, config.rope_parameters)
    rotary = AutoModelForCausalLM.from_pretrained(model_dir).model.rotary_emb
    x = torch.zeros(1)
    for length in (original, config.max_position_embeddings):  # short factors, then long
        cos, sin = rotary(x, torch.arange(length)[None])
        rows = slice(0, original) if length == original else slice(original, length)
        torch.testing.assert_close(ours[rows, :6], cos[0, rows, :6])
        torch.testing.assert_close(ours[rows, 6:], sin[0, rows, :6])


def test_partial_rotary_table_leaves_the_unrotated_dims_alone(tiny_family_dir):
    config = load_config(tiny_family_dir("phi3"))
    rotary = RotaryEmbedding(16, config.max_position_embeddings, *rope_settings(config))
    rotary.build_cache(torch.device("cpu"))
    assert rotary.dim_order == [0, 1, 2, 3, 4, 5, 12, 13, 6, 7, 8, 9, 10, 11, 14, 15]
    cos, sin = rotary.cos_sin[:, :8], rotary.cos_sin[:, 8:]
    assert (cos[:, 6:] == 1).all() and (sin[:, 6:] == 0).all()  # the pairs (12, 14), (13, 15)
    assert not (sin[1:, :6] == 0).any()


@pytest.mark.parametrize(
    "yarn",
    [
        {"factor": 4.0, "original_max_position_embeddings": 64},
        {"factor": 8.0, "original_max_position_embeddings": 32, "truncate": False},
        {"factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2},
        {
            "factor": 40.0,
            "original_max_position_embeddings": 64,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        },
        {"factor": 2.0, "original_max_position_embeddings": 128, "attention_factor": 1.3},
        {"original_max_position_embeddings": 32},  # factor: max positions / original
    ],
)
def test_yarn_tables_match_transformers(yarn):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    config = Qwen3Config(
        head_dim=32, max_position_embeddings=256,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": None} | yarn,
    )  # fmt: skip
    theta, scaling = rope_settings(config)
    rotary = RotaryEmbedding(32, config.max_position_embeddings, theta, scaling)
    rotary.build_cache(torch.device("cpu"))
    cos, sin = Qwen3RotaryEmbedding(config)(torch.zeros(1), torch.arange(256)[None])
    # Our table may run longer (original x factor): its first 256 positions are these.
    torch.testing.assert_close(rotary.cos_sin[:256, :16], cos[0, :, :16])
    torch.testing.assert_close(rotary.cos_sin[:256, 16:], sin[0, :, :16])


def test_yarn_serves_the_context_it_extends_to(tmp_path, tiny_family_dir):
    """With max_position_embeddings at 32 and YaRN x4 over 32 original positions, the
    model takes 128 tokens (vLLM's rule), and its answers past position 32 are still
    transformers' (which rotates any position)."""
    from engine import LLM, SamplingParams
    from engine.models.loader import load_tokenizer
    from tests.reference import PROMPTS, hf_greedy

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    model_dir = edited_copy(
        tiny_family_dir("qwen3"), tmp_path / "m", max_position_embeddings=32,
        rope_parameters=yarn | {"rope_theta": 1e6},
    )  # fmt: skip
    assert max_model_len(load_config(model_dir)) == 128
    prompts = PROMPTS[1:3]  # 20 and 10 tokens, then 24 more: past position 32
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = LLM(model_dir, device="cpu").generate(prompts, params, use_tqdm=False)
    tokenizer = load_tokenizer(model_dir)
    want = [hf_greedy(model_dir, tokenizer.encode(p), 24) for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == want


@pytest.mark.parametrize(
    ("kind", "changes", "message"),
    [
        (
            "qwen3",
            {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e6}},
            "unsupported rope_scaling type 'dynamic'",
        ),
        ("gemma2", {"use_bidirectional_attention": True}, "unsupported use_bidirectional"),
        ("cohere", {"use_qk_norm": True}, "unsupported use_qk_norm"),
        ("gemma4", {"hidden_size_per_layer_input": 16}, "unsupported hidden_size_per_layer"),
        ("gemma4", {"num_kv_shared_layers": 1}, "unsupported num_kv_shared_layers"),
        ("gemma4", {"use_bidirectional_attention": "all"}, "unsupported use_bidirectional"),
        ("phi", {"qk_layernorm": True}, "unsupported qk_layernorm"),
        ("stablelm", {"qk_layernorm": True}, "unsupported qk_layernorm"),
        ("stablelm", {"use_parallel_residual": True}, "unsupported use_parallel_residual"),
        (
            "hunyuan_v1_dense",
            {"rope_parameters": {"type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            "unsupported rope type 'dynamic' without alpha",
        ),
        ("hunyuan_v1_moe", {"moe_topk": [2, 2]}, "unsupported per-layer"),
        ("cohere2_moe", {"expert_selection_fn": "relu"}, "unsupported expert_selection_fn"),
        ("jais2", {"hidden_act": "silu"}, "unsupported hidden_act 'silu'"),
        ("gpt_neox", {"hidden_act": "swish"}, "unsupported hidden_act 'swish'"),
        ("gptj", {"activation_function": "swish"}, "unsupported activation_function 'swish'"),
        ("gpt_bigcode", {"scale_attn_weights": False}, "unsupported attention scale"),
        ("opt", {"do_layer_norm_before": False}, "unsupported post-norm OPT"),
        ("falcon", {"alibi": True}, "unsupported alibi=True"),
        ("falcon", {"activation": "swish"}, "unsupported activation 'swish'"),
        ("opt", {"_remove_final_layer_norm": True}, "unsupported OPT without"),
        ("mistral", {"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
        (  # of the Llama-shaped families, only some rotate part of a head
            "mistral",
            {
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1e4,
                    "partial_rotary_factor": 0.5,
                }
            },
            "unsupported partial_rotary_factor 0.5",
        ),
    ],
)
def test_unsupported_config_features_are_named(tmp_path, tiny_family_dir, kind, changes, message):
    model_dir = edited_copy(tiny_family_dir(kind), tmp_path / "m", **changes)
    with pytest.raises(ModelLoadError, match=rf"config\.json: {message}"):
        load_config(model_dir)


def test_random_weights_marker_loads_without_safetensors(tmp_path, tiny_family_dir):
    from engine.models.loader import RANDOM_WEIGHTS_MARKER

    model_dir = shutil.copytree(tiny_family_dir("qwen3_moe"), tmp_path / "m")
    (model_dir / "model.safetensors").unlink()
    (model_dir / RANDOM_WEIGHTS_MARKER).write_text("")
    model, _ = load_model(str(model_dir), torch.device("cpu"), torch.float32)
    moe = model.layers[0].mlp
    assert moe.w13.abs().max() > 0 and torch.isfinite(moe.w13).all()
    assert (model.norm.weight == 1).all()


@pytest.mark.parametrize("kind", ["qwen3", "phi3"])  # YaRN; LongRoPE
def test_the_rotary_table_stops_at_the_engines_longest_context(tiny_family_dir, kind):
    """No position past max_model_len is rotated, so the cos/sin table stops there (Llama
    4's 10M positions would take 5 GB), its rows those of the whole table."""
    from engine import LLM

    model_dir = tiny_family_dir(kind)
    cpu = torch.device("cpu")
    whole, _ = load_model(model_dir, cpu, torch.float32)
    short, _ = load_model(model_dir, cpu, torch.float32, max_model_len=40)
    assert whole.rotary.cos_sin.shape[0] > 40
    assert torch.equal(short.rotary.cos_sin, whole.rotary.cos_sin[:40])
    llm = LLM(model_dir, device="cpu", max_model_len=40)
    assert llm.engine.model.rotary.cos_sin.shape[0] == 40


def test_ernie_moe_routers_stay_fp32_in_a_bf16_model(tiny_family_dir):
    """As transformers keeps them: the router's weight is read in fp32, not cast each step."""
    model, _ = load_model(tiny_family_dir("ernie4_5_moe"), torch.device("cpu"), torch.bfloat16)
    moe = model.layers[1].mlp
    assert moe.gate.weight.dtype == torch.float32
    assert moe.w13.dtype == torch.bfloat16
