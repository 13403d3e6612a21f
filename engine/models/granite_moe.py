"""IBM Granite 3.x MoE (`granitemoe`: granite-3.1-1b-a400m, 3b-a800m): Granite's four
scalars (granite.py) over Mixtral's routing (the top-k of the router's logits, softmaxed
among themselves) and experts stacked in the checkpoint: input_linear [experts, 2 *
inter, hidden] (gate rows, then up rows) and output_linear [experts, hidden, inter]."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from torch import nn

from engine.models.experts import FusedMoE, load_stacked
from engine.models.granite import GraniteForCausalLM
from engine.models.parallel import WeightSlice

STACKED = re.compile(
    r"(?:model\.)?layers\.(\d+)\.block_sparse_moe\.(input_linear|output_linear)\.weight"
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
                    yield name.replace(".block_sparse_moe.router.layer.", ".mlp.gate."), weight
                    continue
                moe = self.get_submodule(f"layers.{match[1]}.mlp")
                ours = "w13" if match[2] == "input_linear" else "w2"
                try:
                    load_stacked(moe, ours, weight, transposed=False)
                except ValueError as err:
                    raise ValueError(f"{name}: {err}") from err
                loaded.add(f"layers.{match[1]}.mlp.{ours}")

        rest = super().load_weights(others())  # runs others(), which fills `loaded`
        return rest | loaded
