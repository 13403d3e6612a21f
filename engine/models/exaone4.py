"""LG's EXAONE 4.0 (`exaone4`): OLMo 2's post-norm layers (each sublayer's output normed
before it joins the residual stream) with Qwen3's per-head q/k norms, which split across
tensor-parallel ranks as the heads do. With a sliding window, the layers `layer_types`
marks sliding attend locally with rotary positions, and the global ones attend
everywhere without any position encoding (NoPE). EXAONE MoE (`exaone_moe`) has the same
attention in Llama's layers (a norm before each sublayer), dense or MoE by
`mlp_layer_types`, routed as GLM-4.5's."""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from engine.models.glm4_moe import Glm4MoE
from engine.models.layers import layer_sliding_windows
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from engine.models.moe import MoeForCausalLM
from engine.models.olmo2 import Olmo2DecoderLayer
from engine.models.rope import RotaryEmbedding, rotary_of


class Exaone4DecoderLayer(Olmo2DecoderLayer):
    ATTENTION = LlamaAttention  # q/k norms per head (exaone4 is in QK_NORM_MODELS)


def hybrid_rotary(model: LlamaForCausalLM, config) -> list[RotaryEmbedding | None]:
    """Each layer's rotary embedding: the sliding layers', none for the global ones when
    the model has a window (else every layer's)."""
    model.rotary = rotary_of(config)
    hybrid = getattr(config, "sliding_window", None) is not None
    return [model.rotary if w or not hybrid else None for w in layer_sliding_windows(config)]


class Exaone4ForCausalLM(LlamaForCausalLM):
    def make_layers(self, config) -> list[nn.Module]:
        windows = layer_sliding_windows(config)
        return [
            Exaone4DecoderLayer(config, rotary, window, self.tp)
            for rotary, window in zip(hybrid_rotary(self, config), windows, strict=True)
        ]


class ExaoneMoeForCausalLM(MoeForCausalLM):
    RENAMES: ClassVar[dict[str, str]] = {
        ".mlp.e_score_correction_bias": ".mlp.gate.e_score_correction_bias"
    }

    def make_layers(self, config) -> list[nn.Module]:
        windows = layer_sliding_windows(config)
        ropes = hybrid_rotary(self, config)
        return [
            LlamaDecoderLayer(config, ropes[i], windows[i], self.make_mlp(config, i), self.tp)
            for i in range(config.num_hidden_layers)
        ]

    def make_mlp(self, config, layer: int) -> nn.Module:
        if config.mlp_layer_types[layer] == "dense":
            return LlamaMLP(config, self.tp)
        return Glm4MoE(config, self.tp)
