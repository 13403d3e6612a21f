"""Cohere's Command R and Aya (`cohere`): Llama's projections and SwiGLU MLP, with one
LayerNorm (no bias) that attention and the MLP both read, their outputs joining the
residual stream together; the rotation on interleaved pairs of dims (GPT-J's), which
the rotate-half kernels run once q and k's rows are reordered at load (the pair (2i,
2i + 1) to (i, i + head_dim / 2), q and k alike, so their dot products hold); and the
logits times logit_scale, folded into the LM head.

Command R7B and Command A (`cohere2`) are the same layers, the sliding-window ones
(`layer_types`) rotated and the full-attention ones without position encoding. Cohere 2
MoE (`cohere2_moe`, Command A Plus) puts dense layers first (rotated where
`prefix_dense_sliding_window_pattern` is 1) and routed experts after them."""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import torch
from torch import nn

from engine.distributed import TensorParallel
from engine.models.experts import FusedMoE
from engine.models.layers import AddNorm, AttentionMetadata, RMSNorm
from engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, check_config
from engine.models.moe import MoeForCausalLM
from engine.models.parallel import WeightSlice
from engine.models.rope import RotaryEmbedding, interleaved_dim_order, rotary_of
from kernels.fused_moe import select_experts

LayerNormNoBias = partial(AddNorm, rms=False, bias=False)


class CohereLayer(nn.Module):
    def __init__(
        self,
        config,
        rotary: RotaryEmbedding | None,  # None: no position encoding
        tp: TensorParallel,
        norm: nn.Module,
        mlp: nn.Module,
        sliding_window: int = 0,
    ) -> None:
        super().__init__()
        self.input_layernorm = norm
        self.self_attn = LlamaAttention(config, rotary, sliding_window, tp)
        self.mlp = mlp
        # One norm with two readers: each FP8 projection quantizes its own input.
        self.FP8_FEEDS: dict[str, str] = {}

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the last layer's output, not yet added to the residual stream."""
        h, residual = self.input_layernorm(x, residual)
        return self.self_attn(positions, h, meta) + self.mlp(h), residual


def check_cohere_config(config) -> None:
    check_config(config)
    if getattr(config, "use_qk_norm", False):
        raise ValueError("unsupported use_qk_norm=True (Command R+)")


class CohereForCausalLM(LlamaForCausalLM):
    check_config = staticmethod(check_cohere_config)
    LORA_FUSED = None  # q/k rows reordered at load for the rotation of pairs

    def make_layers(self, config) -> list[nn.Module]:
        self.rotary = rotary_of(config)
        # The interleaved pairs to the halves' (LlamaAttention.reorder_rotary_dims).
        head_dim = self.rotary.head_dim
        self.rotary.dim_order = interleaved_dim_order(head_dim, head_dim)
        return [self.make_layer(config, i) for i in range(config.num_hidden_layers)]

    def make_layer(self, config, layer: int) -> nn.Module:
        return self.cohere_layer(config, layer, self.rotary)

    def cohere_layer(
        self, config, layer: int, rotary: RotaryEmbedding | None, sliding_window: int = 0
    ) -> CohereLayer:
        norm, mlp = self.make_norm(config), self.make_mlp(config, layer)
        return CohereLayer(config, rotary, self.tp, norm, mlp, sliding_window)

    def make_norm(self, config) -> nn.Module:
        return LayerNormNoBias(config.hidden_size, config.layer_norm_eps)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        loaded = super().load_weights(weights)
        self.lm_head.weight.mul_(self.config.logit_scale)
        return loaded


class Cohere2ForCausalLM(CohereForCausalLM):
    def make_layer(self, config, layer: int) -> nn.Module:
        if config.layer_types[layer] == "sliding_attention":
            return self.cohere_layer(config, layer, self.rotary, config.sliding_window)
        return self.cohere_layer(config, layer, self.rotary if self.rotated(layer) else None)

    def rotated(self, layer: int) -> bool:
        """Whether a full-attention layer is rotated (only Cohere 2 MoE's dense ones)."""
        return False


class Cohere2MoE(FusedMoE):
    """Top-k of the router's logits, weighted by their softmax, or by their sigmoids
    (`expert_selection_fn`), renormalized where `norm_topk_prob`; shared experts summed
    with the routed ones or averaged with them (`shared_expert_combination_strategy`)."""

    def __init__(self, config, tp: TensorParallel) -> None:
        inter, top_k = config.intermediate_size, config.num_experts_per_tok
        super().__init__(config.hidden_size, inter, config.num_experts, top_k, True, tp)
        self.sigmoid = config.expert_selection_fn == "sigmoid"
        self.renormalize_sigmoids = config.norm_topk_prob
        count = config.num_shared_experts
        self.shared_experts = (
            LlamaMLP(config, tp, intermediate_size=inter * count) if count else None
        )
        self.average = config.shared_expert_combination_strategy == "average"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x).float()
        if self.sigmoid:
            top, ids = logits.topk(self.top_k, dim=-1)
            weights = top.sigmoid()
            if self.renormalize_sigmoids:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        else:  # the softmax of the top-k logits: the renormalized top-k of all of them
            weights, ids = select_experts(logits, self.top_k, True)
        out = self.routed(x, weights, ids)
        if self.shared_experts is None:
            return out
        shared = self.shared_experts(x)
        return (out + shared) / 2 if self.average else out + shared


def check_cohere2_moe_config(config) -> None:
    check_config(config)
    if config.expert_selection_fn not in ("softmax", "sigmoid"):
        raise ValueError(f"unsupported expert_selection_fn {config.expert_selection_fn!r}")
    if config.shared_expert_combination_strategy not in ("sum", "average"):
        strategy = config.shared_expert_combination_strategy
        raise ValueError(f"unsupported shared_expert_combination_strategy {strategy!r}")


class Cohere2MoeForCausalLM(MoeForCausalLM, Cohere2ForCausalLM):
    check_config = staticmethod(check_cohere2_moe_config)

    def rotated(self, layer: int) -> bool:
        dense = self.config.mlp_layer_types[layer] == "dense"
        return dense and self.config.prefix_dense_sliding_window_pattern == 1

    def make_norm(self, config) -> nn.Module:
        if config.rms_norm_eps is not None:
            return RMSNorm(config.hidden_size, config.rms_norm_eps)
        return LayerNormNoBias(config.hidden_size, config.layer_norm_eps)

    def make_mlp(self, config, layer: int) -> nn.Module:
        if config.mlp_layer_types[layer] == "dense":
            size = config.prefix_dense_intermediate_size
            return LlamaMLP(config, self.tp, intermediate_size=size)
        return Cohere2MoE(config, self.tp)
