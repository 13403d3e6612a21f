"""IBM Granite 4.0 (`granitemoehybrid`): Granite's four scalars (granite.py) over layers
that are Mamba-2 mixers (mamba2.py) or attention, by `layer_types`; the attention
without position encoding unless `position_embedding_type` is "rope". Each layer's MLP
is Granite MoE Shared's (experts beside a dense shared MLP), or the shared MLP alone
where the model has no experts (the dense Granite 4.0 models)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import partial
from typing import ClassVar

from torch import nn

from engine.models.granite_moe import GraniteMoeSharedForCausalLM
from engine.models.llama import FUSED, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from engine.models.mamba2 import IN_PROJ_FUSED, Mamba2Mixer, Mamba2Shape, split_in_proj
from engine.models.parallel import WeightSlice
from engine.models.rope import RotaryEmbedding, rotary_of

# The mixer sits where attention does.
MIXER_RENAMES = {".mamba.": ".self_attn.", ".self_attn.norm.weight": ".self_attn.norm_weight"}
MIXER_LAYERS = ("mamba", "linear_attention")  # as published, as transformers 5 names them


def mixer_layers(
    model: LlamaForCausalLM, config, rotary: RotaryEmbedding | None
) -> list[nn.Module]:
    """Llama's decoder layers (the model's MLPs and norms) whose attention is a Mamba-2
    mixer, Granite 4.0-H's, in the layers `layer_types` makes mixers."""
    shape = Mamba2Shape.granite(config)
    return [
        LlamaDecoderLayer(
            config,
            rotary,
            0,
            model.make_mlp(config, i),
            model.tp,
            model.ATTENTION,
            self_attn=Mamba2Mixer(config, shape, model.tp) if kind in MIXER_LAYERS else None,
            norm=partial(model.make_norm, config),
        )
        for i, kind in enumerate(config.layer_types)
    ]


class GraniteMoeHybridForCausalLM(GraniteMoeSharedForCausalLM):
    FUSED: ClassVar[dict[str, tuple[str, int]]] = FUSED | IN_PROJ_FUSED
    LORA_FUSED = None  # adapters on the mixers' projections are not wired
    DENSE_RENAMES: ClassVar[dict[str, str]] = {
        ".shared_mlp.input_linear.": ".mlp.gate_up_proj.",
        ".shared_mlp.output_linear.": ".mlp.down_proj.",
    }

    @staticmethod
    def recurrent(config) -> bool:
        """With mixers (EngineConfig.recurrent_model); the dense Granite 4.0 models' layers
        are attention only."""
        return any(kind in MIXER_LAYERS for kind in config.layer_types)

    def make_layers(self, config) -> list[nn.Module]:
        rotary = rotary_of(config) if config.position_embedding_type == "rope" else None
        return mixer_layers(self, config, rotary)

    def make_mlp(self, config, layer: int) -> nn.Module:
        if config.num_local_experts:
            return super().make_mlp(config, layer)
        return LlamaMLP(config, self.tp, intermediate_size=config.shared_intermediate_size)

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        dense = not self.config.num_local_experts

        def ours() -> Iterator[tuple[str, WeightSlice]]:
            for name, weight in weights:
                for old, new in (self.DENSE_RENAMES if dense else {}).items():
                    name = name.replace(old, new)
                for old, new in MIXER_RENAMES.items():
                    name = name.replace(old, new)
                yield from split_in_proj(name, weight)

        return super().load_weights(ours())
