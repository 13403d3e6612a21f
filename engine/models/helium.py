"""Kyutai's Helium (`helium`): Llama's layers with the rotation on interleaved pairs of
dims, q and k's rows reordered at load for the rotate-half kernels (as Cohere's), and no
o_proj bias whatever attention_bias says."""

from __future__ import annotations

from torch import nn

from engine.models.llama import AttentionOptions, LlamaForCausalLM
from engine.models.rope import interleaved_dim_order


class HeliumForCausalLM(LlamaForCausalLM):
    ATTENTION = AttentionOptions(o_bias=False)
    LORA_FUSED = None  # q/k rows reordered at load for the rotation of pairs

    def make_layers(self, config) -> list[nn.Module]:
        layers = super().make_layers(config)
        head_dim = self.rotary.head_dim
        self.rotary.dim_order = interleaved_dim_order(head_dim, head_dim)
        return layers
