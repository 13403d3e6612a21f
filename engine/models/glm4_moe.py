"""GLM-4.5 and GLM-4.6 (`glm4_moe`): Llama-shaped attention (q/k/v biases, o_proj without
one, half of each head rotated, optional per-head q/k norms) and, after the first
`first_k_dense_replace` dense layers, MoE layers routed as DeepSeek-V3's are: sigmoid
scores, a learned per-expert bias added for the choice only, the best `topk_group` of
`n_group` expert groups (each scored by its two best), top-k within them, the chosen
scores renormalized and times `routed_scaling_factor`; shared experts added to the
routed ones. The multi-token-prediction layers past `num_hidden_layers` are not run."""

from __future__ import annotations

import torch
from torch import nn

from engine.distributed import TensorParallel
from engine.models.experts import FusedMoE
from engine.models.llama import AttentionOptions, LlamaMLP
from engine.models.moe import MoeForCausalLM


def grouped_topk(
    logits: torch.Tensor,  # [num_tokens, num_experts]
    correction: torch.Tensor | None,  # [num_experts]: added to the scores for the choice only
    top_k: int,
    num_groups: int,
    topk_groups: int,
    renormalize: bool,
    scale: float,
    softmax: bool = False,  # the scores a softmax over the experts (Mistral 4), not sigmoids
    eps: float = 1e-20,  # added to the chosen scores' sum when they are renormalized
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [num_tokens, top_k] fp32, ids
    scores = logits.float().softmax(-1) if softmax else logits.float().sigmoid()
    choice = scores if correction is None else scores + correction.float()
    tokens, experts = scores.shape
    per_group = experts // num_groups
    group_scores = choice.view(tokens, num_groups, per_group).topk(2, dim=-1)[0].sum(-1)
    groups = group_scores.topk(topk_groups, dim=-1, sorted=False)[1]
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    choice = choice.masked_fill(~kept.repeat_interleave(per_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
    return weights * scale, ids


class SigmoidMoE(FusedMoE):
    """Experts chosen in one group as DeepSeek-V3's: sigmoid scores plus a per-expert
    correction bias (beside the router, for the choice only), renormalized, times
    `scale` (MiniMax-M2's, and Arcee Trinity's beside shared experts)."""

    def __init__(
        self, hidden: int, inter: int, experts: int, top_k: int, scale: float, tp: TensorParallel
    ) -> None:
        super().__init__(hidden, inter, experts, top_k, True, tp)
        self.gate.e_score_correction_bias = nn.Parameter(torch.empty(experts))
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        correction = self.gate.e_score_correction_bias
        weights, ids = grouped_topk(self.gate(x), correction, self.top_k, 1, 1, True, self.scale)
        return self.routed(x, weights, ids)


class Glm4MoE(FusedMoE):
    SOFTMAX = False  # Mistral 4's: softmax scores and no correction bias

    def __init__(self, config, tp: TensorParallel) -> None:
        experts = getattr(config, "n_routed_experts", None) or config.num_experts  # EXAONE's
        inter = config.moe_intermediate_size
        top_k, renormalize = config.num_experts_per_tok, config.norm_topk_prob
        super().__init__(config.hidden_size, inter, experts, top_k, renormalize, tp)
        if not self.SOFTMAX:
            self.gate.e_score_correction_bias = nn.Parameter(torch.empty(experts))
        self.num_groups, self.topk_groups = config.n_group, config.topk_group
        self.scale = float(config.routed_scaling_factor)
        count = getattr(config, "n_shared_experts", None)
        shared = inter * (config.num_shared_experts if count is None else count)  # EXAONE's
        self.shared_experts = LlamaMLP(config, tp, intermediate_size=shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        weights, ids = grouped_topk(
            self.gate(x),
            getattr(self.gate, "e_score_correction_bias", None),
            self.top_k,
            self.num_groups,
            self.topk_groups,
            self.renormalize,
            self.scale,
            self.SOFTMAX,
        )
        return self.routed(x, weights, ids) + self.shared_experts(x)


class Mistral4MoE(Glm4MoE):
    SOFTMAX = True


class Glm4MoeForCausalLM(MoeForCausalLM):
    ATTENTION = AttentionOptions(o_bias=False)  # whatever attention_bias says

    def make_mlp(self, config, layer: int) -> nn.Module:
        if layer < (getattr(config, "first_k_dense_replace", None) or 0):  # Solar Open: none
            return LlamaMLP(config, self.tp)
        return Glm4MoE(config, self.tp)


class Dots1ForCausalLM(Glm4MoeForCausalLM):
    """dots.llm1 (`dots1`): Qwen3's attention (per-head q/k norms, o_proj biased as q/k/v
    are, by attention_bias) with GLM-4.5's MoE layers."""

    ATTENTION = AttentionOptions()
