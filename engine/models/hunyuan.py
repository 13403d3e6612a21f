"""Tencent's Hunyuan (`hunyuan_v1_dense`, `hunyuan_v1_moe`): Llama's layers whose
per-head q/k RMS norms (query_layernorm, key_layernorm) come after the rotation, so the
rotation runs on its own rather than in the attention kernel; the rope base scaled by
NTK alpha (`dynamic` with `alpha`: theta * alpha^(d / (d - 2)), the same at every
length); in the MoE model every layer routes by a softmax top-k, renormalized, and adds
a shared MLP."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from engine.distributed import TensorParallel
from engine.models.experts import FusedMoE
from engine.models.layers import AttentionMetadata, layer_sliding_windows
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from engine.models.moe import MoeForCausalLM
from engine.models.parallel import WeightSlice, renamed
from engine.models.rope import HeadNorm, RotaryEmbedding, rope_settings, rope_type
from kernels.fp8 import Fp8Rows
from kernels.fused_moe import select_experts
from kernels.rotary import rotary_for


def ntk_alpha_rope(config, head_dim: int) -> tuple[float, dict | None]:
    """(theta, scaling) for RotaryEmbedding: NTK alpha folded into the base."""
    theta, scaling = rope_settings(config)
    if rope_type(scaling) != "dynamic":
        return theta, scaling
    alpha = scaling.get("alpha")
    if not alpha:  # transformers' dynamic NTK rescales by the batch's longest sequence
        raise ValueError("unsupported rope type 'dynamic' without alpha")
    return theta * alpha ** (head_dim / (head_dim - 2)), None


class HunyuanAttention(LlamaAttention):
    def __init__(self, config, rotary: RotaryEmbedding, tp: TensorParallel) -> None:
        super().__init__(config, rotary, 0, tp)
        self.q_norm = HeadNorm(rotary.head_dim, config.rms_norm_eps)
        self.k_norm = HeadNorm(rotary.head_dim, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor | Fp8Rows, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = rotary_for(q.device)(positions, q, k, self.rotary.cos_sin)
        return self.o_proj(self.attn(self.q_norm(q), self.k_norm(k), v, meta, None, None))


class HunyuanForCausalLM(LlamaForCausalLM):
    RENAMES: ClassVar[dict[str, str]] = {
        ".self_attn.query_layernorm.": ".self_attn.q_norm.",
        ".self_attn.key_layernorm.": ".self_attn.k_norm.",
    }

    def make_layers(self, config) -> list[nn.Module]:
        head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
        theta, scaling = ntk_alpha_rope(config, head_dim)
        self.rotary = RotaryEmbedding(head_dim, config.max_position_embeddings, theta, scaling)
        windows = layer_sliding_windows(config)
        return [
            LlamaDecoderLayer(
                config,
                self.rotary,
                windows[i],
                self.make_mlp(config, i),
                self.tp,
                self_attn=HunyuanAttention(config, self.rotary, self.tp),
            )
            for i in range(config.num_hidden_layers)
        ]

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        return super().load_weights(renamed(weights, self.RENAMES))


class HunyuanMoE(FusedMoE):
    def __init__(self, config, tp: TensorParallel) -> None:
        inter, top_k = config.intermediate_size, config.moe_topk
        super().__init__(config.hidden_size, inter, config.num_experts, top_k, True, tp)
        self.shared_mlp = LlamaMLP(config, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, True)
        return self.routed(x, weights, ids) + self.shared_mlp(x)


def check_hunyuan_moe_config(config) -> None:
    if not isinstance(config.num_experts, int) or not isinstance(config.moe_topk, int):
        raise ValueError("unsupported per-layer num_experts or moe_topk (lists)")


class HunyuanMoeForCausalLM(MoeForCausalLM, HunyuanForCausalLM):
    RENAMES: ClassVar[dict[str, str]] = HunyuanForCausalLM.RENAMES | {".mlp.gate.wg.": ".mlp.gate."}

    @staticmethod
    def check_config(config) -> None:
        LlamaForCausalLM.check_config(config)
        check_hunyuan_moe_config(config)

    def make_mlp(self, config, layer: int) -> nn.Module:
        return HunyuanMoE(config, self.tp)
