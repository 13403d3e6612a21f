"""IBM Granite 3.x (GraniteForCausalLM): Llama with four scalars. The embeddings are
multiplied by embedding_multiplier, the attention scale is attention_multiplier, each
sublayer's output is multiplied by residual_multiplier before it joins the residual
stream, and the logits are divided by logits_scaling. Everything else is llama.py's."""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import torch
from torch import nn

from engine.distributed import SINGLE, TensorParallel
from engine.models.experts import FusedMoE
from engine.models.layers import layer_sliding_windows
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.models.parallel import WeightSlice, scale_rows_
from engine.models.rope import RotaryEmbedding, rope_settings
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
            mixer = layer.self_attn  # attention, or Granite 4.0-H's Mamba-2 mixer
            out = mixer.out_proj if hasattr(mixer, "out_proj") else mixer.o_proj
            scale_rows_(out, self.residual_multiplier)
            mlp = layer.mlp  # Granite MoE's experts hold their down projections in w2
            if getattr(mlp, "shared_mlp", None) is not None:  # beside them
                scale_rows_(mlp.shared_mlp.down_proj, self.residual_multiplier)
            if not isinstance(mlp, FusedMoE):
                scale_rows_(mlp.down_proj, self.residual_multiplier)
            elif mlp.w2.dtype == FP8_DTYPE:  # quantized as they loaded: their rows' scales
                mlp.w2_scale.mul_(self.residual_multiplier)
            else:
                mlp.w2.mul_(self.residual_multiplier)
        return loaded


class GraniteSWAForCausalLM(GraniteForCausalLM):
    """Granite SWA (`granite_swa`, granite-swash): Granite's layers, windows by
    `layer_types`, a sink logit per head, and each layer's own rope base
    (`layer_rope_theta`; 0 or none: no position encoding)."""

    def make_layers(self, config) -> list[nn.Module]:
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        scaling = rope_settings(config)[1]
        thetas = config.layer_rope_theta
        rotaries = {
            theta: RotaryEmbedding(head_dim, config.max_position_embeddings, theta, scaling)
            for theta in sorted({theta for theta in thetas if theta})
        }
        windows = layer_sliding_windows(config)
        return [
            LlamaDecoderLayer(
                config,
                rotaries[theta] if theta else None,
                windows[i],
                self.make_mlp(config, i),
                self.tp,
                self.ATTENTION,
                norm=partial(self.make_norm, config),
            )
            for i, theta in enumerate(thetas)
        ]
