"""LG's EXAONE 4.0 (`exaone4`): OLMo 2's post-norm layers (each sublayer's output normed
before it joins the residual stream) with Qwen3's per-head q/k norms, which split across
tensor-parallel ranks as the heads do. With a sliding window, the layers `layer_types`
marks sliding attend locally with rotary positions, and the global ones attend
everywhere without any position encoding (NoPE)."""

from __future__ import annotations

from torch import nn

from engine.models.layers import layer_sliding_windows
from engine.models.llama import LlamaAttention, LlamaForCausalLM
from engine.models.olmo2 import Olmo2DecoderLayer
from engine.models.rope import RotaryEmbedding, rope_settings


class Exaone4DecoderLayer(Olmo2DecoderLayer):
    ATTENTION = LlamaAttention  # q/k norms per head (exaone4 is in QK_NORM_MODELS)


class Exaone4ForCausalLM(LlamaForCausalLM):
    def make_layers(self, config) -> list[nn.Module]:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        theta, scaling = rope_settings(config)
        self.rotary = RotaryEmbedding(head_dim, config.max_position_embeddings, theta, scaling)
        hybrid = getattr(config, "sliding_window", None) is not None
        return [
            Exaone4DecoderLayer(
                config, self.rotary if window or not hybrid else None, window, self.tp
            )
            for window in layer_sliding_windows(config)
        ]
