"""MiniMax-M2 (`minimax_m2`): Llama's layers with q and k RMS-normed over their whole
width before a partial rotation (OLMo 2's norms, summed across tensor-parallel ranks;
`rotary_dim` of each head rotated), and MoE on every layer routed as DeepSeek-V3's in
one group: sigmoid scores, a per-expert correction bias added for the choice only, the
chosen scores renormalized; no shared experts. Its checkpoints name the MoE block
`block_sparse_moe` and each expert's w1/w3/w2, as Mixtral's."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from engine.distributed import TensorParallel
from engine.models.experts import FusedMoE
from engine.models.glm4_moe import grouped_topk
from engine.models.llama import LlamaDecoderLayer
from engine.models.moe import MoeForCausalLM
from engine.models.olmo2 import Olmo2Attention
from engine.models.rope import RotaryEmbedding, rope_settings


class MiniMaxM2MoE(FusedMoE):
    def __init__(self, config, tp: TensorParallel) -> None:
        experts, top_k = config.num_local_experts, config.num_experts_per_tok
        super().__init__(config.hidden_size, config.intermediate_size, experts, top_k, True, tp)
        self.gate.e_score_correction_bias = nn.Parameter(torch.empty(experts))  # GLM-4.5's place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits, correction = self.gate(x), self.gate.e_score_correction_bias
        weights, ids = grouped_topk(logits, correction, self.top_k, 1, 1, True, 1.0)
        return self.routed(x, weights, ids)


class MiniMaxM2ForCausalLM(MoeForCausalLM):
    RENAMES: ClassVar[dict[str, str]] = {
        ".block_sparse_moe.": ".mlp.",
        ".mlp.e_score_correction_bias": ".mlp.gate.e_score_correction_bias",
    }

    def make_layers(self, config) -> list[nn.Module]:
        theta, scaling = rope_settings(config)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, theta, scaling
        )
        return [
            LlamaDecoderLayer(
                config, None, 0, MiniMaxM2MoE(config, self.tp), self.tp,
                self_attn=Olmo2Attention(config, self.rotary, 0, self.tp),
            )
            for _ in range(config.num_hidden_layers)
        ]  # fmt: skip
