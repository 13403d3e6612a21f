"""AllenAI's OLMo 2 and OLMo 3 (Olmo2ForCausalLM, Olmo3ForCausalLM): Llama's attention
and MLP, with the norms moved. Each sublayer's output is RMS-normed before it joins the
residual stream (no norm before a sublayer), and q and k are RMS-normed over their whole
width, every head at once, before the rotation. Those norms span the heads a
tensor-parallel rank would split, so OLMo runs unsharded. OLMo 3 adds sliding-window
layers (`layer_types`), each kind with its own rope settings. OLMoE (`olmoe`) keeps
Llama's norms before each sublayer, with OLMo 2's q/k norms, and MoE layers routed by a
softmax over its experts' top-k (renormalized where `norm_topk_prob`)."""

from __future__ import annotations

import torch
from torch import nn

from engine.distributed import SINGLE, TensorParallel
from engine.models.experts import FusedMoE
from engine.models.layers import AttentionMetadata, RMSNorm, layer_sliding_windows
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from engine.models.moe import MoeForCausalLM
from engine.models.rope import RotaryEmbedding, rope_settings


class Olmo2Attention(LlamaAttention):
    def __init__(
        self, config, rotary: RotaryEmbedding, sliding_window: int, tp: TensorParallel
    ) -> None:
        super().__init__(config, rotary, sliding_window, tp)
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(self.q_size, eps)  # over all of q: every head's dims
        self.k_norm = RMSNorm(self.kv_size, eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.q_norm(q)[0], self.k_norm(k)[0]
        return self.o_proj(self.attn(q, k, v, meta, self.rotary.rope(positions)))


class Olmo2DecoderLayer(nn.Module):
    ATTENTION: type[LlamaAttention] = Olmo2Attention  # EXAONE 4's: per-head q/k norms

    def __init__(
        self, config, rotary: RotaryEmbedding | None, sliding_window: int, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.self_attn = self.ATTENTION(config, rotary, sliding_window, tp)
        self.mlp = LlamaMLP(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,  # the residual stream itself
        residual: None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, None]:
        x = x + self.post_attention_layernorm(self.self_attn(positions, x, meta))[0]
        return x + self.post_feedforward_layernorm(self.mlp(x))[0], None


def check_unsharded(tp: TensorParallel) -> None:
    if tp.size > 1:
        raise ValueError(
            "OLMo normalizes q and k across every head, which tensor-parallel ranks split: "
            "run it with --tensor-parallel-size 1"
        )


class Olmo2ForCausalLM(LlamaForCausalLM):  # and OLMo 3
    def __init__(self, config, tp: TensorParallel = SINGLE) -> None:
        check_unsharded(tp)
        super().__init__(config, tp)

    def make_layers(self, config) -> list[nn.Module]:
        head_dim = config.hidden_size // config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or head_dim
        local, self.rotary = (
            RotaryEmbedding(head_dim, config.max_position_embeddings, *rope_settings(config, kind))
            for kind in ("sliding_attention", "full_attention")
        )
        if (local.theta, local.scaling) == (self.rotary.theta, self.rotary.scaling):
            local = self.rotary  # one table (OLMo 2: the same settings everywhere)
        return [
            Olmo2DecoderLayer(config, local if window else self.rotary, window, self.tp)
            for window in layer_sliding_windows(config)
        ]


class OlmoeForCausalLM(MoeForCausalLM):
    def __init__(self, config, tp: TensorParallel = SINGLE) -> None:
        check_unsharded(tp)
        if getattr(config, "clip_qkv", None) is not None:
            raise ValueError(f"unsupported clip_qkv {config.clip_qkv} (q, k and v clamped)")
        super().__init__(config, tp)

    def make_layers(self, config) -> list[nn.Module]:
        head_dim = config.hidden_size // config.num_attention_heads
        theta, scaling = rope_settings(config)
        self.rotary = RotaryEmbedding(head_dim, config.max_position_embeddings, theta, scaling)
        return [
            LlamaDecoderLayer(
                config, None, 0, self.make_mlp(config, i), self.tp,
                self_attn=Olmo2Attention(config, self.rotary, 0, self.tp),
            )
            for i in range(config.num_hidden_layers)
        ]  # fmt: skip

    def make_mlp(self, config, layer: int) -> nn.Module:
        top_k, renormalize = config.num_experts_per_tok, config.norm_topk_prob
        experts = config.num_experts
        return FusedMoE(
            config.hidden_size, config.intermediate_size, experts, top_k, renormalize, self.tp
        )
