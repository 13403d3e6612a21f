"""IBM Bamba (`bamba`), Granite 4.0-H's forerunner: Llama's layers, each with a SwiGLU MLP,
whose attention (half of each head rotated) is a Mamba-2 mixer (mamba2.py) in every
layer `attn_layer_indices` leaves out; none of Granite's scalars."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import ClassVar

from torch import nn

from engine.models.granite_hybrid import MIXER_LAYERS, MIXER_RENAMES, mixer_layers
from engine.models.llama import FUSED, LlamaForCausalLM
from engine.models.mamba2 import IN_PROJ_FUSED, split_in_proj
from engine.models.parallel import WeightSlice
from engine.models.rope import rotary_of

RENAMES = {
    ".feed_forward.": ".mlp.",
    ".pre_ff_layernorm.": ".post_attention_layernorm.",
    "model.final_layernorm.": "model.norm.",
}


class BambaForCausalLM(LlamaForCausalLM):
    FUSED: ClassVar[dict[str, tuple[str, int]]] = FUSED | IN_PROJ_FUSED
    LORA_FUSED = None  # adapters on the mixers' projections are not wired

    @staticmethod
    def recurrent(config) -> bool:  # EngineConfig.recurrent_model
        return any(kind in MIXER_LAYERS for kind in config.layer_types)

    def make_layers(self, config) -> list[nn.Module]:
        self.rotary = rotary_of(config)
        return mixer_layers(self, config, self.rotary)  # Bamba names them as Granite 4.0-H

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        def ours() -> Iterator[tuple[str, WeightSlice]]:
            for name, weight in weights:
                for old, new in (RENAMES | MIXER_RENAMES).items():
                    name = name.replace(old, new)
                yield from split_in_proj(name, weight)

        return super().load_weights(ours())
