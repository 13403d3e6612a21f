"""GLM-4 (`glm4`: GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1): Gemma 3's layer shape with
plain RMSNorms, each sublayer's output normed before it joins the residual stream
(post_self_attn_layernorm, post_mlp_layernorm); q/k/v biases and o_proj without one;
the rotation on interleaved pairs (GPT-J's) of the first partial_rotary_factor of each
head, which the kernels rotate once the q/k rows are reordered at load (as Cohere's and
Phi-3's are); SiLU's gate and up one tensor in the checkpoint. GLM (`glm`: GLM-4-9B) is
the same without the norms after each sublayer: Llama's layers."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from torch import nn

from engine.models.gemma3 import Gemma3DecoderLayer
from engine.models.layers import layer_sliding_windows
from engine.models.llama import AttentionOptions, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from engine.models.parallel import WeightSlice
from engine.models.rope import RotaryEmbedding, interleaved_dim_order, rotary_of

# GLM-4's norm names -> Gemma 3's for the same places.
NORMS = {
    "post_self_attn_layernorm": "post_attention_layernorm",
    "post_attention_layernorm": "pre_feedforward_layernorm",
    "post_mlp_layernorm": "post_feedforward_layernorm",
}


class Glm4ForCausalLM(LlamaForCausalLM):
    ATTENTION = AttentionOptions(o_bias=False)  # whatever attention_bias says
    LORA_FUSED = None  # q/k rows reordered at load for the rotation of pairs

    @staticmethod
    def rotary_by_pairs(config) -> RotaryEmbedding:
        """The rotation of interleaved pairs, as the kernels take it once q/k are reordered."""
        rotary = rotary_of(config)
        rotary.dim_order = interleaved_dim_order(rotary.head_dim, rotary.rotary_dim)
        return rotary

    def make_layers(self, config) -> list[nn.Module]:
        self.rotary = self.rotary_by_pairs(config)
        return [
            Gemma3DecoderLayer(config, self.rotary, window, self.tp, "silu", self.ATTENTION)
            for window in layer_sliding_windows(config)
        ]

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        def renamed() -> Iterator[tuple[str, WeightSlice]]:
            for name, weight in weights:
                module, _, leaf = name.rpartition(".")
                parent, _, norm = module.rpartition(".")
                if norm in NORMS:
                    name = f"{parent}.{NORMS[norm]}.{leaf}"
                yield name, weight

        return super().load_weights(renamed())


class GlmForCausalLM(Glm4ForCausalLM):
    """GLM-4-9B (`glm`): GLM-4's attention and rotation in Llama's pre-norm layers."""

    def make_layers(self, config) -> list[nn.Module]:
        self.rotary = self.rotary_by_pairs(config)
        return [
            LlamaDecoderLayer(
                config, self.rotary, 0, LlamaMLP(config, self.tp), self.tp, self.ATTENTION
            )
            for _ in range(config.num_hidden_layers)
        ]

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        return LlamaForCausalLM.load_weights(self, weights)  # its norms named as Llama's
