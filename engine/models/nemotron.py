"""Arcee's layers (Llama's attention, the ungated relu^2 MLP) with LayerNorms:

- NVIDIA's Nemotron and Minitron (`nemotron`): half of each head rotated, LayerNorms that
  scale by 1 + weight (LayerNorm1P), their weights read plus one at load;
- Jais 2 (`jais2`): plain LayerNorms."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.models.arcee import ArceeForCausalLM
from engine.models.layers import AddNorm, LayerNorm
from engine.models.parallel import WeightSlice


class NemotronForCausalLM(ArceeForCausalLM):
    def make_norm(self, config) -> nn.Module:
        return LayerNorm(config.hidden_size, config.norm_eps)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        loaded = super().load_weights(weights)
        for module in self.modules():
            if isinstance(module, AddNorm):
                module.weight.add_(1.0)
        return loaded


class Jais2ForCausalLM(ArceeForCausalLM):
    def make_norm(self, config) -> nn.Module:
        return LayerNorm(config.hidden_size, config.layer_norm_eps)
