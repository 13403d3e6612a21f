"""Arcee's Trinity (`afmoe`): per-head q/k norms, the sliding-window layers rotated and
the full-attention ones without position encoding, the attention's output gated by
sigmoid(gate_proj(x)) per dim; a norm after each sublayer as well as before it (as
Gemma 3's); dense layers first (`num_dense_layers`), then experts chosen by sigmoid
scores plus a per-expert bias (for the choice only), renormalized, times `route_scale`,
beside shared experts; the embeddings times sqrt(hidden_size) where `mup_enabled`."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from engine.distributed import TensorParallel
from engine.models.gemma3 import Gemma3DecoderLayer
from engine.models.glm4_moe import SigmoidMoE
from engine.models.layers import AttentionMetadata, layer_sliding_windows
from engine.models.llama import LlamaAttention, LlamaMLP
from engine.models.moe import MoeForCausalLM
from engine.models.parallel import ColumnParallelLinear
from engine.models.rope import RotaryEmbedding, rotary_of
from kernels.fp8 import Fp8Rows


class AfmoeAttention(LlamaAttention):
    def __init__(
        self, config, rotary: RotaryEmbedding | None, sliding_window: int, tp: TensorParallel
    ) -> None:
        super().__init__(config, rotary, sliding_window, tp)
        # gate_proj: this rank's q heads' rows, as qkv_proj's q section; renamed at load
        # (the MLP's gate_proj is the first half of gate_up_proj).
        self.output_gate = ColumnParallelLinear(
            config.hidden_size, [self.qkv_proj.sections[0]], False
        )

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor | Fp8Rows, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        out = self.attend(positions, q, k, v, meta)
        return self.o_proj(out * torch.sigmoid(self.output_gate(x)))


class AfmoeLayer(Gemma3DecoderLayer):
    """Gemma 3's layer: a norm before and after each sublayer (pre_mlp_layernorm and
    post_mlp_layernorm, renamed at load)."""

    FP8_FEEDS: ClassVar[dict[str, str | tuple[str, ...]]] = {  # quantize_model
        "input_layernorm": ("self_attn.qkv_proj", "self_attn.output_gate"),
        "pre_feedforward_layernorm": "mlp.gate_up_proj",
    }


class AfmoeMoE(SigmoidMoE):
    def __init__(self, config, tp: TensorParallel) -> None:
        inter, experts, top_k = (
            config.moe_intermediate_size,
            config.num_experts,
            config.num_experts_per_tok,
        )
        super().__init__(config.hidden_size, inter, experts, top_k, float(config.route_scale), tp)
        shared = inter * config.num_shared_experts
        self.shared_experts = LlamaMLP(config, tp, intermediate_size=shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shared_experts(x)


class AfmoeForCausalLM(MoeForCausalLM):
    LORA_FUSED = None  # PEFT's gate_proj names the attention's output gate as well
    RENAMES: ClassVar[dict[str, str]] = {
        ".mlp.router.gate.": ".mlp.gate.",
        ".self_attn.gate_proj.": ".self_attn.output_gate.",
        ".mlp.expert_bias": ".mlp.gate.e_score_correction_bias",
        ".pre_mlp_layernorm.": ".pre_feedforward_layernorm.",
        ".post_mlp_layernorm.": ".post_feedforward_layernorm.",
    }

    def make_layers(self, config) -> list[nn.Module]:
        self.rotary = rotary_of(config)
        return [
            AfmoeLayer(
                config,
                self.rotary if w else None,
                w,
                self.tp,
                mlp=self.make_mlp(config, i),
                self_attn=AfmoeAttention(config, self.rotary if w else None, w, self.tp),
            )
            for i, w in enumerate(layer_sliding_windows(config))
        ]

    def make_mlp(self, config, layer: int) -> nn.Module:
        if layer < config.num_dense_layers:
            return LlamaMLP(config, self.tp)
        return AfmoeMoE(config, self.tp)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * self.config.hidden_size**0.5 if self.config.mup_enabled else x
