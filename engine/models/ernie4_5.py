"""Baidu's ERNIE 4.5 dense models (`ernie4_5`: ERNIE-4.5-0.3B): Llama's layers with the
rotation on interleaved pairs of each head's dims (GLM's style, over the whole head),
which the kernels rotate once the q/k rows are reordered at load."""

from __future__ import annotations

from torch import nn

from engine.models.llama import LlamaForCausalLM, check_config
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
