"""IBM Granite 3.x MoE (`granitemoe`: granite-3.1-1b-a400m, 3b-a800m): Granite's four
scalars (granite.py) over Mixtral's routing (the top-k of the router's logits, softmaxed
among themselves) and experts stacked in the checkpoint: input_linear [experts, 2 *
inter, hidden] (gate rows, then up rows) and output_linear [experts, hidden, inter]."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from torch import nn

from engine.models.experts import FusedMoE
from engine.models.granite import GraniteForCausalLM
from engine.models.parallel import TensorSlice, WeightSlice, check_shape

STACKED = re.compile(
    r"(?:model\.)?layers\.(\d+)\.block_sparse_moe\.(input_linear|output_linear)\.weight"
)


def load_stacked(moe: FusedMoE, tensor: str, weight: WeightSlice) -> None:
    """One stacked expert tensor into the FusedMoE, expert by expert (its load_shard takes
    this rank's rows or columns)."""
    num_experts, hidden, inter = moe.w2.shape[0], moe.w2.shape[1], moe.inter.size
    shape = [2 * inter, hidden] if tensor == "input_linear" else [hidden, inter]
    check_shape(weight, [num_experts, *shape])
    for e in range(num_experts):
        matrix = weight[e : e + 1][0]
        if tensor == "output_linear":
            moe.load_shard("w2", TensorSlice(matrix), (e, None))
        else:
            moe.load_shard("w13", TensorSlice(matrix[:inter]), (e, 0))
            moe.load_shard("w13", TensorSlice(matrix[inter:]), (e, 1))


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
                try:
                    load_stacked(moe, match[2], weight)
                except ValueError as err:
                    raise ValueError(f"{name}: {err}") from err
                ours = "w13" if match[2] == "input_linear" else "w2"
                loaded.add(f"layers.{match[1]}.mlp.{ours}")

        rest = super().load_weights(others())  # runs others(), which fills `loaded`
        return rest | loaded
