"""IBM Granite 3.x (GraniteForCausalLM): Llama with four scalars. The embeddings are
multiplied by embedding_multiplier, the attention scale is attention_multiplier, each
sublayer's output is multiplied by residual_multiplier before it joins the residual
stream, and the logits are divided by logits_scaling. Everything else is llama.py's."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.distributed import SINGLE, TensorParallel
from engine.models.experts import FusedMoE
from engine.models.llama import LlamaForCausalLM
from engine.models.parallel import WeightSlice, scale_rows_
from kernels.fp8 import FP8_DTYPE


class GraniteForCausalLM(LlamaForCausalLM):
    def __init__(self, config, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, tp)
        self.embedding_multiplier = float(config.embedding_multiplier)
        self.residual_multiplier = float(config.residual_multiplier)
        self.logits_scaling = float(config.logits_scaling)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) / self.logits_scaling

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        loaded = super().load_weights(weights)
        # A sublayer's output times the multiplier is its output projection's, scaled: the
        # multiplier goes into o_proj's and down_proj's weights (every rank's shard), so
        # the fused add + norm kernels take the outputs as they are.
        for layer in self.layers:
            scale_rows_(layer.self_attn.o_proj, self.residual_multiplier)
            mlp = layer.mlp  # Granite MoE's experts hold their down projections in w2
            if not isinstance(mlp, FusedMoE):
                scale_rows_(mlp.down_proj, self.residual_multiplier)
            elif mlp.w2.dtype == FP8_DTYPE:  # quantized as they loaded: their rows' scales
                mlp.w2_scale.mul_(self.residual_multiplier)
            else:
                mlp.w2.mul_(self.residual_multiplier)
        return loaded
