"""Arcee's AFM (`arcee`): Llama's layers with an MLP of no gate, down(relu(up(x))^2)."""

from __future__ import annotations

from functools import partial
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import TensorParallel
from engine.models.llama import FUSED, LlamaForCausalLM, check_config
from engine.models.parallel import ColumnParallelLinear, RowParallelLinear, split
from kernels.fp8 import Fp8Rows


class ReluSquaredMLP(nn.Module):
    """up column-parallel, down row-parallel; biases where `mlp_bias`."""

    def __init__(self, config, tp: TensorParallel) -> None:
        super().__init__()
        inner = split(config.intermediate_size, tp, "intermediate_size")
        bias = getattr(config, "mlp_bias", False)
        self.up_proj = ColumnParallelLinear(config.hidden_size, [inner], bias=bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias, tp)

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(x)).square())


class ArceeForCausalLM(LlamaForCausalLM):
    # up_proj is a projection of its own, not gate_up_proj's second half.
    FUSED: ClassVar[dict[str, tuple[str, int]]] = {
        name: fused for name, fused in FUSED.items() if fused[0] == "qkv_proj"
    }
    LORA_FUSED = None  # adapters on the ungated MLP are not wired
    check_config = staticmethod(partial(check_config, act="relu2", mlp_bias=True))

    def make_mlp(self, config, layer: int) -> nn.Module:
        return ReluSquaredMLP(config, self.tp)
