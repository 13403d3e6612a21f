"""Liquid AI LFM2 (`lfm2`, `lfm2_moe`): Llama-shaped layers whose attention (per-head q/k
RMS norms) stands where `layer_types` says "full_attention"; elsewhere a short
convolution: in_proj gives B, C and x, B x passes a causal depthwise convolution of
`conv_L_cache` taps (no activation after it), and C times its output goes to out_proj. A
conv layer's only state is its last conv_L_cache - 1 rows per sequence, kept as the
recurrent layers keep theirs (gated_delta.py). A SwiGLU MLP after each layer, sized as
transformers sizes it; LFM2-MoE's after its first `num_dense_layers` are experts chosen
by sigmoid scores plus a bias for the choice, renormalized and scaled."""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import torch
from torch import nn

from engine.distributed import SINGLE, TensorParallel
from engine.models.experts import FusedMoE
from engine.models.gated_delta import ConvRecurrentLayer, DepthwiseConv
from engine.models.glm4_moe import grouped_topk
from engine.models.layers import AttentionMetadata, RMSNorm, SequenceSpans, SequenceWalk
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from engine.models.moe import MoeForCausalLM
from engine.models.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    WeightSlice,
    renamed,
    split,
)
from engine.models.rope import rotary_of
from kernels.conv_step import conv_step_at_slots_for

RENAMES = {
    ".self_attn.out_proj.": ".self_attn.o_proj.",  # before the conv layers take the name
    ".self_attn.q_layernorm.": ".self_attn.q_norm.",
    ".self_attn.k_layernorm.": ".self_attn.k_norm.",
    ".conv.conv.": ".self_attn.conv1d.",
    ".conv.": ".self_attn.",
    ".operator_norm.": ".input_layernorm.",
    ".ffn_norm.": ".post_attention_layernorm.",
    ".feed_forward.w1.": ".mlp.gate_proj.",
    ".feed_forward.w3.": ".mlp.up_proj.",
    ".feed_forward.w2.": ".mlp.down_proj.",
    ".feed_forward.": ".mlp.",  # LFM2-MoE's experts and router
    ".mlp.expert_bias": ".mlp.gate.e_score_correction_bias",
    "model.embedding_norm.": "model.norm.",
}


class ShortConv(ConvRecurrentLayer):
    """B, C and x from one projection, each hidden-wide; each rank holds its share of the
    channels, and out_proj sums the ranks'."""

    CONV_SILU = False

    def __init__(self, config, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        channels = split(config.hidden_size, tp, "hidden_size")
        bias = config.conv_bias
        self.in_proj = ColumnParallelLinear(config.hidden_size, [channels] * 3, bias=bias)
        self.conv1d = DepthwiseConv([channels], config.conv_L_cache, bias)
        self.out_proj = RowParallelLinear(config.hidden_size, config.hidden_size, bias, tp)
        self.channels = channels.local_size
        self.conv_state = torch.empty(0)  # by slot: see RecurrentLayer

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        return {"conv_state": ((self.channels, self.conv1d.weight.shape[1] - 1), None)}

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        b, c, v = self.in_proj(x).split(self.channels, dim=-1)
        bx = b * v
        if meta.is_decode:
            y = self.step_rows(bx, meta.state_slots, meta.seq_lens > 1)
        else:
            y = self.run_sequences(meta, (1, self.channels), bx)
        return self.out_proj(c * y.flatten(1).to(x.dtype))

    def step_rows(
        self, bx: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor
    ) -> torch.Tensor:  # [rows, 1, channels] fp32
        conv = conv_step_at_slots_for(bx.device)
        weight, bias = self.conv1d.weight, self.conv1d.bias
        return conv(bx, self.conv_state, slots, has_state, weight, bias, False).float()[:, None]

    def run_prompts(self, conved: torch.Tensor, spans: SequenceSpans) -> torch.Tensor:
        return conved.float()[:, :, None]  # the convolution is the whole rule

    def walk_tokens(self, conved: torch.Tensor, walk: SequenceWalk) -> torch.Tensor:
        return conved.float()[:, None]


def mlp_size(config) -> int:
    """The MLP's width as transformers' Lfm2MLP derives it (block_auto_adjust_ff_dim)."""
    size = config.intermediate_size
    if config.block_auto_adjust_ff_dim:
        size = int(2 * size / 3)
        if config.block_ffn_dim_multiplier is not None:
            size = int(config.block_ffn_dim_multiplier * size)
            multiple = config.block_multiple_of
            size = multiple * ((size + multiple - 1) // multiple)
    return size


class Lfm2MoE(FusedMoE):
    """LFM2-MoE's experts: top-k of the router's sigmoids, chosen with a per-expert bias
    added (`use_expert_bias`), renormalized (`norm_topk_prob`) and scaled."""

    def __init__(self, config, tp: TensorParallel) -> None:
        experts, top_k = config.num_experts, config.num_experts_per_tok
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        super().__init__(hidden, inter, experts, top_k, config.norm_topk_prob, tp)
        if config.use_expert_bias:
            self.gate.e_score_correction_bias = nn.Parameter(torch.empty(experts))
        self.scale = float(config.routed_scaling_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = getattr(self.gate, "e_score_correction_bias", None)
        weights, ids = grouped_topk(
            self.gate(x), bias, self.top_k, 1, 1, self.renormalize, self.scale, eps=1e-6
        )
        return self.routed(x, weights, ids)


class Lfm2ForCausalLM(LlamaForCausalLM):
    LORA_FUSED = None  # adapters on the conv layers' projections are not wired

    @staticmethod
    def recurrent(config) -> bool:  # EngineConfig.recurrent_model
        return "conv" in config.layer_types

    def make_norm(self, config) -> nn.Module:
        return RMSNorm(config.hidden_size, config.norm_eps)

    def make_layers(self, config) -> list[nn.Module]:
        self.rotary = rotary_of(config)
        return [
            LlamaDecoderLayer(
                config,
                self.rotary,
                0,
                self.make_mlp(config, i),
                self.tp,
                self.ATTENTION,
                self_attn=ShortConv(config, self.tp) if kind == "conv" else None,
                norm=partial(self.make_norm, config),
            )
            for i, kind in enumerate(config.layer_types)
        ]

    def make_mlp(self, config, layer: int) -> nn.Module:
        return LlamaMLP(config, self.tp, intermediate_size=mlp_size(config))

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        return super().load_weights(renamed(weights, RENAMES))


class Lfm2MoeForCausalLM(Lfm2ForCausalLM, MoeForCausalLM):
    """LFM2-MoE (`lfm2_moe`): its experts' tensors read as MoeForCausalLM reads Mixtral's
    (w1, w3, w2 per expert)."""

    def make_mlp(self, config, layer: int) -> nn.Module:
        if layer < config.num_dense_layers:
            return LlamaMLP(config, self.tp)
        return Lfm2MoE(config, self.tp)
