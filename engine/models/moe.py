"""Mixture-of-experts Llama-shaped models: Qwen3-MoE (q/k norm, norm_topk_prob, dense
layers by mlp_only_layers / decoder_sparse_step), Qwen2-MoE (the same routing, qkv bias,
and a shared expert beside the routed ones, scaled by a sigmoid gate) and Mixtral
(sliding window, renormalized top-k), and Qwen3-VL-MoE's language model (Qwen3-MoE,
always renormalized); Qwen3-Next's MLPs are Qwen2-MoE's (its layers: qwen3_5.py).
Attention is llama.py's; each sparse layer's MLP is a FusedMoE whose stacked expert
weights are filled from HF's per-expert tensors at load, or from tensors that stack
them already (Qwen3-VL-MoE's)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
from torch import nn

from engine.distributed import TensorParallel
from engine.models.experts import FusedMoE, load_stacked
from engine.models.llama import LlamaForCausalLM, LlamaMLP
from engine.models.parallel import WeightSlice, load_weight, renamed

# HF per-expert projection -> (our stacked parameter, half of w13 it fills; None: all of w2).
EXPERT_WEIGHTS = {
    "gate_proj": ("w13", 0),  # Qwen3-MoE
    "up_proj": ("w13", 1),
    "down_proj": ("w2", None),
    "w1": ("w13", 0),  # Mixtral
    "w3": ("w13", 1),
    "w2": ("w2", None),
}
EXPERT = re.compile(r"(.+)\.experts\.(\d+)\.(\w+)\.weight")
STACKED = re.compile(r"(.+)\.experts\.(gate_up_proj|down_proj)")


# Families whose published checkpoints stack each expert's matrix transposed.
TRANSPOSED_STACKS = ("qwen3_vl_moe_text",)


def transposed(moe: FusedMoE, ours: str, weight: WeightSlice, model_type: str) -> bool:
    """Whether a stacked tensor holds each expert's matrix transposed ([experts, hidden,
    2 * inter] gate/up, as Qwen3-VL-MoE's published checkpoints; transformers 5 saves
    [experts, 2 * inter, hidden]). A square matrix (Mistral 4's at its 4,096 width) is
    taken in its family's published layout."""
    hidden, inter = moe.w2.shape[1], moe.inter.size
    rows, cols = (2 * inter, hidden) if ours == "w13" else (hidden, inter)
    if rows == cols:
        return model_type in TRANSPOSED_STACKS
    return list(weight.get_shape()[1:]) == [cols, rows]


def num_experts(config) -> int:  # 0: none (a dense Gemma 4 loads through MoeForCausalLM)
    return getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0)


class SharedExpertMoE(FusedMoE):
    """Qwen2-MoE's sparse block: the routed experts plus a dense shared expert whose output
    is scaled by sigmoid(shared_expert_gate(x)) (one logit a token)."""

    def __init__(self, config, inter: int, renormalize: bool, tp: TensorParallel) -> None:
        top_k = config.num_experts_per_tok
        super().__init__(config.hidden_size, inter, num_experts(config), top_k, renormalize, tp)
        size = config.shared_expert_intermediate_size
        self.shared_expert = LlamaMLP(config, tp, intermediate_size=size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return super().forward(x) + shared


class MoeForCausalLM(LlamaForCausalLM):
    RENAMES: ClassVar[dict[str, str]] = {".block_sparse_moe.": ".mlp."}  # Mixtral's MoE: `mlp`

    def make_mlp(self, config, layer: int) -> nn.Module:
        if config.model_type == "mixtral":
            sparse, renormalize = True, True
        else:  # qwen3_moe, qwen2_moe, qwen3_next
            step = getattr(config, "decoder_sparse_step", 1)
            sparse = layer not in (config.mlp_only_layers or []) and (layer + 1) % step == 0
            # Qwen3-VL-MoE's transformers code renormalizes whatever the config says.
            always = config.model_type == "qwen3_vl_moe_text"
            renormalize = always or getattr(config, "norm_topk_prob", False)
        if not sparse:
            return LlamaMLP(config, self.tp)
        inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        if config.model_type in ("qwen2_moe", "qwen3_next"):
            return SharedExpertMoE(config, inter, renormalize, self.tp)
        return FusedMoE(
            config.hidden_size,
            inter,
            num_experts(config),
            config.num_experts_per_tok,
            renormalize,
            self.tp,
        )

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        params = dict(self.named_parameters())
        filled: Counter[str] = Counter()

        def others() -> Iterator[tuple[str, WeightSlice]]:
            """Reads the expert tensors into their stacks; yields everything else."""
            for name, weight in renamed(weights, self.RENAMES):
                stacked = STACKED.fullmatch(name.removeprefix("model."))
                if stacked is not None:
                    moe = self.get_submodule(stacked[1])
                    ours = "w13" if stacked[2] == "gate_up_proj" else "w2"
                    flip = transposed(moe, ours, weight, self.config.model_type)
                    load_stacked(moe, ours, weight, flip)
                    halves = 2 if ours == "w13" else 1  # as many as per-expert tensors fill
                    filled[f"{stacked[1]}.{ours}"] += halves * num_experts(self.config)
                    continue
                match = EXPERT.fullmatch(name.removeprefix("model."))
                if match is None:
                    yield name, weight
                    continue
                moe, expert, proj = match[1], int(match[2]), match[3]
                if proj not in EXPERT_WEIGHTS or f"{moe}.w2" not in params:
                    raise ValueError(f"unexpected weight {name!r}")
                ours, half = EXPERT_WEIGHTS[proj]
                load_weight(self.get_submodule(moe), ours, weight, name, (expert, half))
                filled[f"{moe}.{ours}"] += 1

        loaded = super().load_weights(others())
        experts = num_experts(self.config)
        for name, count in filled.items():
            if count == (2 if name.endswith("w13") else 1) * experts:
                loaded.add(name)
        return loaded
