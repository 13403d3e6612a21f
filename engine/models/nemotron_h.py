"""NVIDIA Nemotron-H (`nemotron_h`: Nemotron-H 8B/47B/56B, Nemotron Nano 2, Nemotron 3): a
stack of blocks, each one RMS-normed mixer added to the residual stream: a Mamba-2 mixer
(mamba2.py), attention without position encoding, an ungated relu^2 MLP, or (Nemotron 3)
a mixture of ungated relu^2 experts routed as DeepSeek-V3's beside a shared one, by
`layer_types` (the config's `hybrid_override_pattern`). The multi-token-prediction
layers are not run. A Mamba-2 language model (`mamba2`: Mamba-Codestral) is the same
stack with a mixer in every block."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import TensorParallel
from engine.models.arcee import ArceeForCausalLM, UngatedMLP, relu_squared
from engine.models.experts import FusedMoE
from engine.models.glm4_moe import grouped_topk
from engine.models.layers import AttentionMetadata, RMSNorm
from engine.models.llama import LlamaAttention
from engine.models.mamba2 import IN_PROJ_FUSED, Mamba2Mixer, Mamba2Shape, split_in_proj
from engine.models.parallel import WeightSlice, load_weight
from kernels.activation import Relu2

RENAMES = {
    "backbone.": "model.",  # as published
    "model.embeddings.": "model.embed_tokens.",
    "model.norm_f.": "model.norm.",
    ".mixer.norm.weight": ".mixer.norm_weight",  # a Mamba-2 mixer's gated norm
}


EXPERT = re.compile(r"(.+\.mixer)\.experts\.(\d+)\.(up_proj|down_proj)\.weight")


class NemotronHMoE(FusedMoE):
    """Nemotron 3's MoE block: relu^2 experts without a gate, chosen as DeepSeek-V3's
    (sigmoid scores, a correction bias for the choice, groups; glm4_moe.grouped_topk) from
    router logits in fp32, as transformers keeps its router; an ungated shared expert
    beside them. With `moe_latent_size`, the experts work at that width between a
    projection down from the hidden size and one back up."""

    def __init__(self, config, tp: TensorParallel) -> None:
        latent = getattr(config, "moe_latent_size", None)
        width, experts = latent or config.hidden_size, config.n_routed_experts
        inter, top_k = config.moe_intermediate_size, config.num_experts_per_tok
        super().__init__(width, inter, experts, top_k, config.norm_topk_prob, tp, act=Relu2())
        self.gate = nn.Linear(config.hidden_size, experts, bias=False)  # the router
        self.gate.e_score_correction_bias = nn.Parameter(torch.empty(experts))
        self.num_groups, self.topk_groups = config.n_group, config.topk_group
        self.scale = float(config.routed_scaling_factor)
        shared = config.moe_shared_expert_intermediate_size
        self.shared_experts = UngatedMLP(config, tp, relu_squared, shared)
        self.fc1_latent_proj = self.fc2_latent_proj = None
        if latent:  # replicated on every rank: the experts' sum comes back at `latent` wide
            bias = getattr(config, "mlp_bias", False)
            self.fc1_latent_proj = nn.Linear(config.hidden_size, latent, bias=bias)
            self.fc2_latent_proj = nn.Linear(latent, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        logits = F.linear(x.float(), self.gate.weight.float())
        correction = self.gate.e_score_correction_bias
        weights, ids = grouped_topk(
            logits, correction, self.top_k, self.num_groups, self.topk_groups,
            self.renormalize, self.scale,
        )  # fmt: skip
        h = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        out = self.routed(h, weights, ids)
        out = out if self.fc2_latent_proj is None else self.fc2_latent_proj(out)
        return out + self.shared_experts(x)


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
            if kind == "moe":
                return NemotronHMoE(config, self.tp)
            return UngatedMLP(config, self.tp, relu_squared)

        return [
            NemotronHBlock(self.make_norm(config), mixer(kind), kind in ("mlp", "moe"))
            for kind in config.layer_types
        ]

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        filled: Counter[str] = Counter()  # each MoE's w13 and w2: experts read into them

        def ours() -> Iterator[tuple[str, WeightSlice]]:
            for name, weight in weights:
                for old, new in RENAMES.items():
                    name = name.replace(old, new)
                expert = EXPERT.fullmatch(name.removeprefix("model."))
                if expert is None:
                    yield from split_in_proj(name, weight)
                    continue
                moe, index, proj = expert[1], int(expert[2]), expert[3]
                leaf, section = ("w13", 0) if proj == "up_proj" else ("w2", None)
                load_weight(self.get_submodule(moe), leaf, weight, name, (index, section))
                filled[f"{moe}.{leaf}"] += 1

        loaded = super().load_weights(ours())
        experts = self.config.n_routed_experts if "moe" in self.config.layer_types else 0
        return loaded | {name for name, count in filled.items() if count == experts}


class Mamba2ForCausalLM(NemotronHForCausalLM):
    """`mamba2`: a normed Mamba-2 mixer a block, nothing else. transformers keeps the
    residual stream in fp32 (`residual_in_fp32`); here it is in the model dtype."""

    @staticmethod
    def check_config(config) -> None:
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (only silu)")

    @staticmethod
    def recurrent(config) -> bool:
        return True

    def make_layers(self, config) -> list[nn.Module]:
        shape = Mamba2Shape.mamba2(config)
        return [
            NemotronHBlock(self.make_norm(config), Mamba2Mixer(config, shape, self.tp), False)
            for _ in range(config.num_hidden_layers)
        ]
