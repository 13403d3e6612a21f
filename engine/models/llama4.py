"""Llama 4 (Scout, Maverick): `llama4_text`, and the language model of a `llama4`
checkpoint (text only). Llama's layers with:

- the rotation on interleaved pairs of each head's dims (q/k rows reordered at load, as
  ERNIE 4.5's), and after it q and k RMS-normed without weights (`use_qk_norm`);
- every fourth layer without position encoding (`no_rope_layers` 0): there the queries
  are scaled by log1p(floor((position + 1) / floor_scale)) * attn_scale + 1
  (`attn_temperature_tuning`), and not normed;
- the rotary layers attending within chunks of `attention_chunk_size` tokens: a query
  sees the keys from the start of its chunk on (kernels' `chunk`);
- MoE layers (`moe_layers`) routed top-1 by a sigmoid of the chosen logit, which scales
  the expert's input, not its output; a shared expert beside it; dense layers' MLPs of
  `intermediate_size_mlp`.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from engine.distributed import TensorParallel
from engine.models.experts import FusedMoE
from engine.models.layers import AttentionMetadata
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, check_config
from engine.models.moe import MoeForCausalLM
from engine.models.rope import RotaryEmbedding, interleaved_dim_order, rotary_of
from kernels.fp8 import Fp8Rows


def check_llama4_config(config) -> None:
    check_config(config)
    if config.num_experts_per_tok != 1:  # each expert's input is scaled by its own score
        raise ValueError(f"unsupported num_experts_per_tok {config.num_experts_per_tok} (1)")


class Llama4MoE(FusedMoE):
    """The routed expert (top-1: its input times sigmoid(logit)) plus a shared expert."""

    def __init__(self, config, tp: TensorParallel) -> None:
        experts, inter = config.num_local_experts, config.intermediate_size
        super().__init__(config.hidden_size, inter, experts, 1, False, tp)
        self.shared_expert = LlamaMLP(config, tp, intermediate_size=inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logit, ids = self.gate(x).topk(1, dim=-1)
        routed_in = x * torch.sigmoid(logit.float()).to(x.dtype)
        ones = torch.ones(ids.shape, dtype=torch.float32, device=x.device)
        return self.routed(routed_in, ones, ids) + self.shared_expert(x)


class Llama4Attention(LlamaAttention):
    """A rotary layer's q/k norms have no weights (ones, filled at load); a NoPE layer
    has no norms and scales its queries by their position (attention temperature)."""

    def __init__(self, config, rotary: RotaryEmbedding | None, tp: TensorParallel) -> None:
        super().__init__(config, rotary, 0, tp)
        chunk = getattr(config, "attention_chunk_size", None)
        self.attn.chunk = chunk if rotary is not None and chunk else 0
        self.tempered = rotary is None and config.attn_temperature_tuning
        if rotary is None:
            self.q_norm = self.k_norm = None
        # The step's query scale [num_tokens, 1], the same in every NoPE layer: set once a
        # step from Llama4ForCausalLM.query_scale.
        self.q_scale: torch.Tensor | None = None

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor | Fp8Rows, meta: AttentionMetadata
    ) -> torch.Tensor:
        if not self.tempered:
            return super().forward(positions, x, meta)
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = (q * self.q_scale).to(q.dtype)
        return self.o_proj(self.attn(q, k, v, meta, None, None))

    @torch.no_grad()
    def fill_norms(self) -> list[str]:
        """The weightless norms' ones; their parameter names (relative to this module)."""
        if self.q_norm is None:
            return []
        self.q_norm.weight.fill_(1.0)
        self.k_norm.weight.fill_(1.0)
        return ["q_norm.weight", "k_norm.weight"]


class Llama4ForCausalLM(MoeForCausalLM):
    check_config = staticmethod(check_llama4_config)
    LORA_FUSED = None  # q/k rows reordered at load for the rotation of pairs
    RENAMES: ClassVar[dict[str, str]] = {".feed_forward.": ".mlp.", ".mlp.router.": ".mlp.gate."}

    def make_layers(self, config) -> list[nn.Module]:
        self.rotary = rotary_of(config)
        head_dim = self.rotary.head_dim
        self.rotary.dim_order = interleaved_dim_order(head_dim, head_dim)
        layers = []
        for i, rope in enumerate(config.no_rope_layers):
            attention = Llama4Attention(config, self.rotary if rope else None, self.tp)
            mlp = self.make_mlp(config, i)
            layers.append(LlamaDecoderLayer(config, None, 0, mlp, self.tp, self_attn=attention))
        return layers

    def query_scale(self, positions: torch.Tensor) -> torch.Tensor | None:
        config = self.config
        if not config.attn_temperature_tuning:
            return None
        floor = torch.floor((positions.float() + 1.0) / config.floor_scale)
        return (torch.log1p(floor) * config.attn_scale + 1.0)[:, None]

    def make_mlp(self, config, layer: int) -> nn.Module:
        if layer in config.moe_layers:
            return Llama4MoE(config, self.tp)
        return LlamaMLP(config, self.tp, intermediate_size=config.intermediate_size_mlp)

    def load_weights(self, weights) -> set[str]:
        loaded = super().load_weights(weights)
        for i, layer in enumerate(self.layers):
            loaded.update(f"layers.{i}.self_attn.{name}" for name in layer.self_attn.fill_norms())
        return loaded
