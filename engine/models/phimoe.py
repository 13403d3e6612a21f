"""Microsoft's Phi-3.5-MoE (`phimoe`): Llama's attention (biases where attention_bias),
LayerNorms, an LM head with a bias where lm_head_bias, and experts chosen by sparsemixer:
the top expert, then the best of the rest, each weighted by a softmax over the logits
within a relative margin (2 x router_jitter_noise) of its own. The rotary tables are
LongRoPE's with explicit scales (short_mscale, long_mscale; engine/models/rope.py)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from engine.distributed import SINGLE, TensorParallel
from engine.models.experts import FusedMoE
from engine.models.layers import LayerNorm
from engine.models.moe import MoeForCausalLM


def sparsemixer(
    logits: torch.Tensor, margin: float
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [num_tokens, 2] fp32, ids [num_tokens, 2]
    """transformers' sparsemixer at inference: two experts, each the best of the logits
    not taken yet, weighted by a softmax over the logits near enough to it."""
    scores, weights, ids = logits.float(), [], []
    masked = scores
    for _ in range(2):
        best, best_id = masked.max(dim=-1, keepdim=True)
        far = (best - scores) / scores.abs().clamp(min=best) > 2 * margin
        gates = masked.masked_fill(far, float("-inf")).softmax(dim=-1)
        weights.append(gates.gather(-1, best_id))
        ids.append(best_id)
        masked = masked.scatter(-1, best_id, float("-inf"))
    return torch.cat(weights, dim=-1), torch.cat(ids, dim=-1)


class PhimoeMoE(FusedMoE):
    def __init__(self, config, tp: TensorParallel) -> None:
        experts = config.num_local_experts
        super().__init__(config.hidden_size, config.intermediate_size, experts, 2, False, tp)
        self.margin = float(config.router_jitter_noise)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = sparsemixer(self.gate(x), self.margin)
        return self.routed(x, weights, ids)


def check_phimoe_config(config) -> None:
    MoeForCausalLM.check_config(config)
    if config.num_experts_per_tok != 2:  # sparsemixer picks two
        raise ValueError(f"unsupported num_experts_per_tok {config.num_experts_per_tok}")


class PhimoeForCausalLM(MoeForCausalLM):
    check_config = staticmethod(check_phimoe_config)
    RENAMES: ClassVar[dict[str, str]] = {
        ".block_sparse_moe.": ".mlp.",
        ".mlp.router.": ".mlp.gate.",
    }

    def __init__(self, config, tp: TensorParallel = SINGLE) -> None:
        self.HEAD_BIAS = bool(config.lm_head_bias)
        super().__init__(config, tp)

    def make_norm(self, config) -> nn.Module:
        return LayerNorm(config.hidden_size, config.rms_norm_eps)

    def make_mlp(self, config, layer: int) -> nn.Module:
        return PhimoeMoE(config, self.tp)
