"""NVIDIA Nemotron-H (`nemotron_h`: Nemotron-H 8B/47B/56B, Nemotron Nano 2): a stack of
blocks, each one RMS-normed mixer added to the residual stream: a Mamba-2 mixer
(mamba2.py), attention without position encoding, or an ungated relu^2 MLP, by
`layer_types` (the config's `hybrid_override_pattern`). Nemotron 3's MoE blocks
(ungated relu^2 experts, sigmoid group routing) are refused by name."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
from torch import nn

from engine.models.arcee import ArceeForCausalLM, UngatedMLP, relu_squared
from engine.models.layers import AttentionMetadata, RMSNorm
from engine.models.llama import LlamaAttention
from engine.models.mamba2 import IN_PROJ_FUSED, Mamba2Mixer, Mamba2Shape, split_in_proj
from engine.models.parallel import WeightSlice

RENAMES = {
    "backbone.": "model.",  # as published
    "model.embeddings.": "model.embed_tokens.",
    "model.norm_f.": "model.norm.",
    ".mixer.norm.weight": ".mixer.norm_weight",  # a Mamba-2 mixer's gated norm
}


class NemotronHBlock(nn.Module):
    """norm, then one mixer: forward(positions, x, residual, meta) as a decoder layer's."""

    def __init__(self, norm: nn.Module, mixer: nn.Module, mlp: bool) -> None:
        super().__init__()
        self.norm, self.mixer, self.mlp = norm, mixer, mlp

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.norm(x, residual)
        return (self.mixer(h) if self.mlp else self.mixer(positions, h, meta)), residual


class NemotronHForCausalLM(ArceeForCausalLM):
    FUSED: ClassVar[dict[str, tuple[str, int]]] = ArceeForCausalLM.FUSED | IN_PROJ_FUSED

    @staticmethod
    def check_config(config) -> None:
        """Raise ValueError naming what this code would not serve as the config says."""
        if "moe" in config.layer_types:
            raise ValueError("Nemotron-H's MoE blocks (Nemotron 3) are not supported")
        for name, act in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
            if getattr(config, name) != act:
                raise ValueError(f"unsupported {name} {getattr(config, name)!r} (only {act})")

    @staticmethod
    def recurrent(config) -> bool:  # EngineConfig.recurrent_model
        return "linear_attention" in config.layer_types

    def make_norm(self, config) -> nn.Module:
        return RMSNorm(config.hidden_size, config.layer_norm_epsilon)

    def make_layers(self, config) -> list[nn.Module]:
        shape = Mamba2Shape.nemotron_h(config)

        def mixer(kind: str) -> nn.Module:
            if kind == "linear_attention":
                return Mamba2Mixer(config, shape, self.tp)
            if kind == "full_attention":
                return LlamaAttention(config, None, 0, self.tp, self.ATTENTION)
            return UngatedMLP(config, self.tp, relu_squared)

        return [
            NemotronHBlock(self.make_norm(config), mixer(kind), kind == "mlp")
            for kind in config.layer_types
        ]

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        def ours() -> Iterator[tuple[str, WeightSlice]]:
            for name, weight in weights:
                for old, new in RENAMES.items():
                    name = name.replace(old, new)
                yield from split_in_proj(name, weight)

        return super().load_weights(ours())
