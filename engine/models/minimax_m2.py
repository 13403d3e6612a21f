"""MiniMax-M2 (`minimax_m2`): Llama's layers with q and k RMS-normed over their whole
width before a partial rotation (OLMo 2's norms, summed across tensor-parallel ranks;
`rotary_dim` of each head rotated), and MoE on every layer routed as DeepSeek-V3's in
one group: sigmoid scores, a per-expert correction bias added for the choice only, the
chosen scores renormalized; no shared experts. Its checkpoints name the MoE block
`block_sparse_moe` and each expert's w1/w3/w2, as Mixtral's."""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from engine.models.glm4_moe import SigmoidMoE
from engine.models.llama import LlamaDecoderLayer
from engine.models.moe import MoeForCausalLM
from engine.models.olmo2 import Olmo2Attention
from engine.models.rope import rotary_of


class MiniMaxM2ForCausalLM(MoeForCausalLM):
    RENAMES: ClassVar[dict[str, str]] = {
        ".block_sparse_moe.": ".mlp.",
        ".mlp.e_score_correction_bias": ".mlp.gate.e_score_correction_bias",
    }

    def make_layers(self, config) -> list[nn.Module]:
        self.rotary = rotary_of(config)
        return [
            LlamaDecoderLayer(
                config, None, 0, self.make_mlp(config, i), self.tp,
                self_attn=Olmo2Attention(config, self.rotary, 0, self.tp),
            )
            for i in range(config.num_hidden_layers)
        ]  # fmt: skip

    def make_mlp(self, config, layer: int) -> nn.Module:
        experts, top_k = config.num_local_experts, config.num_experts_per_tok
        inter = config.intermediate_size
        return SigmoidMoE(config.hidden_size, inter, experts, top_k, 1.0, self.tp)
