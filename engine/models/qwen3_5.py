"""Qwen 3.5 (dense and MoE) text models: three Gated DeltaNet layers (gated_delta.py) to
each attention layer, by `layer_types`. The attention layers have q/k norms, a quarter of
each head rotated, and an output gate: q_proj gives each head's query and then its gate
(sigmoid, times the attention's output). Every RMSNorm but the DeltaNet's gated one
scales by (1 + weight), folded in at load. The MoE model's every layer has Qwen2-MoE's
experts with a gated shared expert, always renormalized. The multimodal checkpoints
serve their language model (multimodal.py).

Qwen3-Next is the MoE model one release earlier: its DeltaNet projections are fused by
key head (GroupedGatedDeltaNet), and its dense layers and top-k renormalization follow
the config, as Qwen3-MoE's do."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
from torch import nn

from engine.distributed import SINGLE, TensorParallel
from engine.models.gated_delta import GatedDeltaNet, GroupedGatedDeltaNet
from engine.models.layers import AttentionMetadata
from engine.models.llama import FUSED, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from engine.models.moe import MoeForCausalLM, SharedExpertMoE
from engine.models.parallel import (
    ColumnParallelLinear,
    Section,
    TensorSlice,
    WeightSlice,
    read,
    split,
)
from engine.models.rope import rotary_of
from kernels.fp8 import Fp8Rows

# HF names -> ours: the DeltaNet sits where attention does; q_proj fills the query and the
# gate sections of qkv_proj, in_proj_qkv the q, k and v sections of the DeltaNet's in_proj
# (Qwen3-Next's in_proj_qkvz and in_proj_ba all six).
RENAMES = {".linear_attn.": ".self_attn.", ".self_attn.norm.weight": ".self_attn.norm_weight"}
SPLIT = {
    "q_proj": ("q_proj", "q_gate"),
    "in_proj_qkv": ("in_proj_q", "in_proj_k", "in_proj_v"),
    "in_proj_qkvz": ("in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z"),
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
}
QWEN3_5_FUSED = FUSED | {
    "q_gate": ("qkv_proj", 3),
    "in_proj_q": ("in_proj", 0),
    "in_proj_k": ("in_proj", 1),
    "in_proj_v": ("in_proj", 2),
    "in_proj_z": ("in_proj", 3),
    "in_proj_b": ("in_proj", 4),
    "in_proj_a": ("in_proj", 5),
}
# Norms transformers applies as (1 + weight).
UNIT_OFFSET_NORMS = ("q_norm", "k_norm", "input_layernorm", "post_attention_layernorm")


class GatedAttention(LlamaAttention):
    """Llama's attention with q_proj's gate rows as a fourth section of qkv_proj: the
    checkpoint interleaves them head by head ([query, gate] a head), so each section
    reads its rows of this rank's heads out of the one tensor."""

    def __init__(self, config, rotary, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, rotary, 0, tp)
        heads, dim = config.num_attention_heads, self.attn.head_dim
        first, last = split(heads, tp, "num_attention_heads").ranges[0]
        mine = range(first, last)
        query = Section(2 * heads * dim, tuple((2 * h * dim, (2 * h + 1) * dim) for h in mine))
        gate = Section(query.size, tuple(((2 * h + 1) * dim, (2 * h + 2) * dim) for h in mine))
        _, k, v = self.qkv_proj.sections
        bias = self.qkv_proj.bias is not None  # attention_bias: q_proj's interleaved alike
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [query, k, v, gate], bias)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor | Fp8Rows, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v, gate = self.qkv_proj(x).split(
            [self.q_size, self.kv_size, self.kv_size, self.q_size], dim=-1
        )
        return self.o_proj(self.attend(positions, q, k, v, meta) * torch.sigmoid(gate))


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    FUSED: ClassVar[dict[str, tuple[str, int]]] = QWEN3_5_FUSED
    LORA_FUSED = None  # adapters on the DeltaNet's projections are not wired
    DELTA_NET: ClassVar[type[GatedDeltaNet]] = GatedDeltaNet

    @staticmethod
    def recurrent(config) -> bool:  # EngineConfig.recurrent_model
        return True

    def make_layers(self, config) -> list[nn.Module]:
        self.rotary = rotary_of(config)
        return [
            LlamaDecoderLayer(
                config,
                self.rotary,
                0,
                self.make_mlp(config, i),
                self.tp,
                self_attn=(
                    self.DELTA_NET(config, self.tp)
                    if kind == "linear_attention"
                    else GatedAttention(config, self.rotary, self.tp)
                ),
            )
            for i, kind in enumerate(config.layer_types)
        ]

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        def ours() -> Iterator[tuple[str, WeightSlice]]:
            for name, weight in weights:
                if name.startswith("mtp."):  # the multi-token prediction layers: unused
                    continue
                for old, new in RENAMES.items():
                    name = name.replace(old, new)
                module, _, leaf = name.rpartition(".")
                owner, _, proj = module.rpartition(".")
                if module.removeprefix("model.") == "norm" or proj in UNIT_OFFSET_NORMS:
                    weight = TensorSlice(1.0 + read(weight, weight.get_shape()).float())
                if proj not in SPLIT:
                    yield name, weight
                for part in SPLIT.get(proj, ()):  # each section reads its own rows
                    yield f"{owner}.{part}.{leaf}", weight

        return super().load_weights(ours())


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM, MoeForCausalLM):
    def make_mlp(self, config, layer: int) -> nn.Module:
        return SharedExpertMoE(config, config.moe_intermediate_size, True, self.tp)


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM, MoeForCausalLM):
    """make_mlp is MoeForCausalLM's: experts with a shared expert except on
    mlp_only_layers (and off decoder_sparse_step), renormalized by norm_topk_prob."""

    DELTA_NET = GroupedGatedDeltaNet
