"""IBM Granite 3.x MoE (`granitemoe`: granite-3.1-1b-a400m, 3b-a800m): Granite's four
scalars (granite.py) over Mixtral's routing (the top-k of the router's logits, softmaxed
among themselves) and experts stacked in the checkpoint: input_linear [experts, 2 *
inter, hidden] (gate rows, then up rows) and output_linear [experts, hidden, inter]."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
from torch import nn

from engine.distributed import TensorParallel
from engine.models.experts import FusedMoE, load_stacked
from engine.models.granite import GraniteForCausalLM, GraniteSWAForCausalLM
from engine.models.llama import LlamaMLP
from engine.models.parallel import WeightSlice, renamed

# As published (input_linear, output_linear), or as transformers 5 saves a family with no
# conversion of its own (Granite MoE SWA's: experts.gate_up_proj, experts.down_proj).
STACKED = re.compile(
    r"(?:model\.)?layers\.(\d+)\.block_sparse_moe\."
    r"(input_linear\.weight|output_linear\.weight|experts\.gate_up_proj|experts\.down_proj)"
)


class GraniteMoeForCausalLM(GraniteForCausalLM):
    def make_mlp(self, config, layer: int) -> nn.Module:
        experts, top_k = config.num_local_experts, config.num_experts_per_tok
        return FusedMoE(config.hidden_size, config.intermediate_size, experts, top_k, True, self.tp)

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        loaded: set[str] = set()

        def others() -> Iterator[tuple[str, WeightSlice]]:
            """Reads the stacked experts into each FusedMoE; yields everything else."""
            for name, weight in weights:
                match = STACKED.fullmatch(name)
                if match is None:
                    name = name.replace(".block_sparse_moe.router.layer.", ".mlp.gate.")
                    yield name.replace(".block_sparse_moe.router.", ".mlp.gate."), weight
                    continue
                moe = self.get_submodule(f"layers.{match[1]}.mlp")
                ours = (
                    "w13" if match[2] in ("input_linear.weight", "experts.gate_up_proj") else "w2"
                )
                try:
                    load_stacked(moe, ours, weight, transposed=False)
                except ValueError as err:
                    raise ValueError(f"{name}: {err}") from err
                loaded.add(f"layers.{match[1]}.mlp.{ours}")

        rest = super().load_weights(others())  # runs others(), which fills `loaded`
        return rest | loaded


class GraniteSharedMoE(FusedMoE):
    """Granite MoE Shared's MLP: the routed experts plus a dense shared one."""

    def __init__(self, config, tp: TensorParallel) -> None:
        experts, top_k = config.num_local_experts, config.num_experts_per_tok
        super().__init__(config.hidden_size, config.intermediate_size, experts, top_k, True, tp)
        size = config.shared_intermediate_size
        self.shared_mlp = LlamaMLP(config, tp, intermediate_size=size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shared_mlp(x)


class GraniteMoeSharedForCausalLM(GraniteMoeForCausalLM):
    """Granite MoE Shared (`granitemoeshared`): a dense MLP beside each layer's experts
    where `shared_intermediate_size`, its gate and up rows in one tensor (input_linear)."""

    RENAMES: ClassVar[dict[str, str]] = {
        ".shared_mlp.input_linear.": ".mlp.shared_mlp.gate_up_proj.",
        ".shared_mlp.output_linear.": ".mlp.shared_mlp.down_proj.",
    }

    def make_mlp(self, config, layer: int) -> nn.Module:
        if not config.shared_intermediate_size:
            return super().make_mlp(config, layer)
        return GraniteSharedMoE(config, self.tp)

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        return super().load_weights(renamed(weights, self.RENAMES))


class GraniteMoeSWAForCausalLM(GraniteMoeSharedForCausalLM, GraniteSWAForCausalLM):
    """Granite MoE SWA (`granitemoe_swa`): Granite SWA's attention over Granite MoE
    Shared's MLPs."""
