"""Cohere's Command R and Aya (`cohere`): Llama's projections and SwiGLU MLP, with one
LayerNorm (no bias) that attention and the MLP both read, their outputs joining the
residual stream together; the rotation on interleaved pairs of dims (GPT-J's), which
the rotate-half kernels run once q and k's rows are reordered at load (the pair (2i,
2i + 1) to (i, i + head_dim / 2), q and k alike, so their dot products hold); and the
logits times logit_scale, folded into the LM head.

Command R7B and Command A (`cohere2`) are the same layers, the sliding-window ones
(`layer_types`) rotated and the full-attention ones without position encoding."""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import torch
from torch import nn

from engine.distributed import TensorParallel
from engine.models.layers import AddNorm, AttentionMetadata
from engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, check_config
from engine.models.parallel import WeightSlice
from engine.models.rope import RotaryEmbedding, interleaved_dim_order, rope_settings

LayerNormNoBias = partial(AddNorm, rms=False, bias=False)


class CohereLayer(nn.Module):
    def __init__(
        self,
        config,
        rotary: RotaryEmbedding | None,  # None: no position encoding
        tp: TensorParallel,
        sliding_window: int = 0,
    ) -> None:
        super().__init__()
        self.input_layernorm = LayerNormNoBias(config.hidden_size, config.layer_norm_eps)
        self.self_attn = LlamaAttention(config, rotary, sliding_window, tp)
        self.mlp = LlamaMLP(config, tp)
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
        head_dim = config.hidden_size // config.num_attention_heads
        theta, scaling = rope_settings(config)
        self.rotary = RotaryEmbedding(head_dim, config.max_position_embeddings, theta, scaling)
        # The interleaved pairs to the halves' (LlamaAttention.reorder_rotary_dims).
        self.rotary.dim_order = interleaved_dim_order(head_dim, head_dim)
        return [self.make_layer(config, i) for i in range(config.num_hidden_layers)]

    def make_layer(self, config, layer: int) -> nn.Module:
        return CohereLayer(config, self.rotary, self.tp)

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
            return CohereLayer(config, self.rotary, self.tp, config.sliding_window)
        return CohereLayer(config, None, self.tp)
