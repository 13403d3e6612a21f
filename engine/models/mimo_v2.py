"""MiMo-V2-Flash (`mimo_v2_flash`): Llama-shaped layers whose q/k heads are wider than
their V heads (head_dim, v_head_dim), V times attention_value_scale, a third of each q/k
head rotated with a rope base per layer kind; sliding-window layers with twice the kv
heads and a sink logit per head between full-attention ones; the first layer's MLP
dense, the rest DeepSeek-V3's experts (sigmoid scores plus a correction bias for the
choice, the best groups' top-k renormalized, times routed_scaling_factor) with no shared
expert, routed in fp32 as transformers does. V is padded to the q/k width in the cache,
so that the attention kernels read one head size; each head's output is cut back to
v_head_dim before o_proj."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import SINGLE, TensorParallel
from engine.models.experts import FusedMoE
from engine.models.glm4_moe import grouped_topk
from engine.models.layers import AttentionMetadata, layer_sliding_windows
from engine.models.llama import (
    AttentionOptions,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    check_config,
)
from engine.models.moe import MoeForCausalLM
from engine.models.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    WeightSlice,
    head_shard,
    split,
)
from engine.models.rope import RotaryEmbedding, rotary_of


class MiMoV2Attention(LlamaAttention):
    def __init__(
        self,
        config,
        rotary: RotaryEmbedding,
        sliding_window: int,
        tp: TensorParallel = SINGLE,
    ) -> None:
        num_kv_heads = config.num_key_value_heads * (2 if sliding_window else 1)
        options = AttentionOptions(num_kv_heads=num_kv_heads)
        super().__init__(config, rotary, sliding_window, tp, options)
        num_heads, self.v_dim = config.num_attention_heads, config.v_head_dim
        v = head_shard(num_heads, num_kv_heads, self.v_dim, tp).sections[2]
        sections = [*self.qkv_proj.sections[:2], v]
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size, sections, self.qkv_proj.bias is not None
        )
        self.o_proj = RowParallelLinear(num_heads * self.v_dim, config.hidden_size, False, tp)
        self.v_size = v.local_size
        self.v_scale = getattr(config, "attention_value_scale", None) or 1.0
        if sliding_window:  # a sink logit per q head
            self.sink_heads = split(num_heads, tp, "num_attention_heads")
            self.sinks = nn.Parameter(torch.empty(self.q_size // config.head_dim))

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.v_size], dim=-1)
        width, n = self.attn.head_dim, len(x)
        v = (v * self.v_scale).view(n, -1, self.v_dim)
        v = F.pad(v, (0, width - self.v_dim)).view(n, -1)  # as wide as K
        out = self.attend(positions, q, k, v, meta).view(n, -1, width)[..., : self.v_dim]
        return self.o_proj(out.reshape(n, -1))


class MiMoV2MoE(FusedMoE):
    def __init__(self, config, tp: TensorParallel) -> None:
        experts, inter = config.n_routed_experts, config.moe_intermediate_size
        top_k, renormalize = config.num_experts_per_tok, config.norm_topk_prob
        super().__init__(config.hidden_size, inter, experts, top_k, renormalize, tp)
        self.gate.e_score_correction_bias = nn.Parameter(torch.empty(experts))
        self.num_groups, self.topk_groups = config.n_group, config.topk_group
        self.scale = float(config.routed_scaling_factor or 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        logits = F.linear(x.float(), self.gate.weight)  # the router's weight kept in fp32
        correction = self.gate.e_score_correction_bias
        weights, ids = grouped_topk(
            logits,
            correction,
            self.top_k,
            self.num_groups,
            self.topk_groups,
            self.renormalize,
            self.scale,
        )
        return self.routed(x, weights, ids)


class MiMoV2FlashForCausalLM(MoeForCausalLM):
    LORA_FUSED: ClassVar[dict[str, tuple[str, int]] | None] = None  # V's own head size
    RENAMES: ClassVar[dict[str, str]] = {".attention_sink_bias": ".sinks"}  # as published

    @staticmethod
    def check_config(config) -> None:
        check_config(config)
        if config.v_head_dim > config.head_dim:
            raise ValueError(
                f"unsupported v_head_dim {config.v_head_dim} > head_dim {config.head_dim}"
            )

    def make_layers(self, config) -> list[nn.Module]:
        self.rotaries = {
            kind: rotary_of(config, kind) for kind in ("full_attention", "sliding_attention")
        }
        windows = layer_sliding_windows(config)
        layers = []
        for i, window in enumerate(windows):
            rotary = self.rotaries["sliding_attention" if window else "full_attention"]
            attention = MiMoV2Attention(config, rotary, window, self.tp)
            mlp = self.make_mlp(config, i)
            layers.append(
                LlamaDecoderLayer(config, rotary, window, mlp, self.tp, self_attn=attention)
            )
        return layers

    def make_mlp(self, config, layer: int) -> nn.Module:
        if config.mlp_layer_types[layer] == "sparse":
            return MiMoV2MoE(config, self.tp)
        return LlamaMLP(config, self.tp)

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        for module in self.modules():  # the routers read in fp32, not cast every step
            if isinstance(module, MiMoV2MoE):
                module.gate.float()
        return super().load_weights(weights)
