"""Llama's layers with an MLP of no gate, down(act(up(x))):

- Arcee's AFM (`arcee`): act relu(x)^2;
- Swiss AI's Apertus (`apertus`): act xIELU, whose coefficients each layer learns, and
  per-head q/k norms; its layer norms are named attention_layernorm and
  feedforward_layernorm."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import TensorParallel
from engine.models.llama import FUSED, LlamaForCausalLM, check_config
from engine.models.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    WeightSlice,
    renamed,
    split,
)
from kernels.fp8 import Fp8Rows


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


class XIELU(nn.Module):
    """x > 0: alpha_p x^2 + beta x; else (expm1(min(x, eps)) - x) alpha_n + beta x, where
    alpha_p = softplus(a_p) and alpha_n = beta + softplus(a_n) (transformers' xIELU)."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha_p = nn.Parameter(torch.empty(1))
        self.alpha_n = nn.Parameter(torch.empty(1))
        self.beta = nn.Parameter(torch.empty(()))  # the checkpoint's buffers
        self.eps = nn.Parameter(torch.empty(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        negative = (torch.expm1(torch.minimum(x, self.eps)) - x) * alpha_n
        return torch.where(x > 0, alpha_p * x * x, negative) + self.beta * x


class UngatedMLP(nn.Module):
    """up column-parallel, down row-parallel; biases where `mlp_bias`."""

    def __init__(
        self,
        config,
        tp: TensorParallel,
        act: Callable[[torch.Tensor], torch.Tensor],
        intermediate_size: int | None = None,  # None: the config's
    ) -> None:
        super().__init__()
        size = intermediate_size or config.intermediate_size
        inner = split(size, tp, "intermediate_size")
        bias = getattr(config, "mlp_bias", False)
        self.up_proj = ColumnParallelLinear(config.hidden_size, [inner], bias=bias)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias, tp)
        self.act_fn = act

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))


class ArceeForCausalLM(LlamaForCausalLM):
    # up_proj is a projection of its own, not gate_up_proj's second half.
    FUSED: ClassVar[dict[str, tuple[str, int]]] = {
        name: fused for name, fused in FUSED.items() if fused[0] == "qkv_proj"
    }
    LORA_FUSED = None  # adapters on the ungated MLP are not wired
    check_config = staticmethod(partial(check_config, act="relu2", mlp_bias=True))

    def make_mlp(self, config, layer: int) -> nn.Module:
        return UngatedMLP(config, self.tp, relu_squared)


class ApertusForCausalLM(ArceeForCausalLM):
    check_config = staticmethod(partial(check_config, act="xielu"))
    RENAMES: ClassVar[dict[str, str]] = {
        ".attention_layernorm.": ".input_layernorm.",
        ".feedforward_layernorm.": ".post_attention_layernorm.",
    }

    def make_mlp(self, config, layer: int) -> nn.Module:
        return UngatedMLP(config, self.tp, XIELU())

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        return super().load_weights(renamed(weights, self.RENAMES))
