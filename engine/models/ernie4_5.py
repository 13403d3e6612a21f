"""Baidu's ERNIE 4.5 models: Llama's layers with the rotation on interleaved pairs of
each head's dims (GLM's style, over the whole head), which the kernels rotate once the
q/k rows are reordered at load. Dense (`ernie4_5`: ERNIE-4.5-0.3B) and MoE
(`ernie4_5_moe`: ERNIE-4.5-21B-A3B, 300B-A47B): MoE layers by `moe_layer_start_index`,
`moe_layer_end_index` and `moe_layer_interval`, routed by softmax scores plus a
per-expert correction bias for the choice only, the chosen scores renormalized (floored
at `moe_norm_min`), with shared experts beside them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import TensorParallel
from engine.models.experts import FusedMoE
from engine.models.llama import LlamaForCausalLM, LlamaMLP, check_config
from engine.models.moe import MoeForCausalLM
from engine.models.parallel import WeightSlice
from engine.models.rope import interleaved_dim_order


def check_ernie_config(config) -> None:
    check_config(config)
    if getattr(config, "use_bias", False):
        raise ValueError("unsupported use_bias=True (biases on every projection)")


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    check_config = staticmethod(check_ernie_config)
    LORA_FUSED = None  # q/k rows reordered at load for the rotation of pairs

    def make_layers(self, config) -> list[nn.Module]:
        layers = super().make_layers(config)
        self.rotary.dim_order = interleaved_dim_order(self.rotary.head_dim, self.rotary.rotary_dim)
        return layers


class Ernie4_5MoE(FusedMoE):
    def __init__(self, config, tp: TensorParallel) -> None:
        experts, inter = config.num_experts, config.moe_intermediate_size
        super().__init__(config.hidden_size, inter, experts, config.num_experts_per_tok, True, tp)
        self.gate.e_score_correction_bias = nn.Parameter(torch.empty(1, experts))  # as saved
        self.norm_min = config.moe_norm_min
        shared = inter * config.moe_num_shared_experts
        self.shared_experts = LlamaMLP(config, tp, intermediate_size=shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The router in fp32, as transformers keeps it (its weight fp32 from the load on).
        scores = F.linear(x.float(), self.gate.weight.float()).softmax(dim=-1)
        choice = scores + self.gate.e_score_correction_bias.float()
        ids = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=self.norm_min)
        routed = self.routed(x, weights, ids)
        return routed if self.shared_experts is None else routed + self.shared_experts(x)


class Ernie4_5MoeForCausalLM(MoeForCausalLM, Ernie4_5ForCausalLM):
    RENAMES: ClassVar[dict[str, str]] = {".mlp.moe_statics.": ".mlp.gate."}

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        for module in self.modules():  # the routers read in fp32, not cast every step
            if isinstance(module, Ernie4_5MoE):
                module.gate.float()
        return super().load_weights(weights)

    def make_mlp(self, config, layer: int) -> nn.Module:
        start, end = config.moe_layer_start_index, config.moe_layer_end_index
        if (layer + 1) % config.moe_layer_interval == 0 and start <= layer <= end:
            return Ernie4_5MoE(config, self.tp)
        return LlamaMLP(config, self.tp)
