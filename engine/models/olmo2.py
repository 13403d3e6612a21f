"""AllenAI's OLMo (`olmo`: OLMo-1B/7B): Llama's layers with LayerNorms that have no
weights, and q, k and v clamped to +-clip_qkv where set.

OLMo 2 and OLMo 3 (Olmo2ForCausalLM, Olmo3ForCausalLM): Llama's attention
and MLP, with the norms moved. Each sublayer's output is RMS-normed before it joins the
residual stream (no norm before a sublayer), and q and k are RMS-normed over their whole
width, every head at once, before the rotation. Tensor-parallel ranks hold parts of that
width: each sums its part's squares and one all-reduce adds them up. OLMo 3 adds sliding-window
layers (`layer_types`), each kind with its own rope settings. OLMoE (`olmoe`) keeps
Llama's norms before each sublayer, with OLMo 2's q/k norms, and MoE layers routed by a
softmax over its experts' top-k (renormalized where `norm_topk_prob`)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import partial

import torch
from torch import nn

from engine.distributed import SINGLE, TensorParallel
from engine.models.experts import FusedMoE
from engine.models.layers import (
    AddNorm,
    AttentionMetadata,
    LayerNorm,
    RMSNorm,
    layer_sliding_windows,
)
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from engine.models.moe import MoeForCausalLM
from engine.models.parallel import Section, WeightSlice, head_shard, read
from engine.models.rope import RotaryEmbedding, rotary_of
from engine.models.weight_copy import fill
from kernels.fp8 import Fp8Rows
from kernels.norms import add_norm_for


class WidthNorm(nn.Module):
    """RMSNorm weights over a projection's whole width (OLMo's q and k norms): this rank's
    rows of them, where its heads are."""

    def __init__(self, rows: Section, eps: float) -> None:
        super().__init__()
        self.rows = rows
        self.weight = nn.Parameter(torch.ones(rows.local_size))
        self.eps = eps

    def load_shard(self, leaf: str, weight: WeightSlice, section: None) -> None:
        fill(self.weight.data, read(weight, [self.rows.size], self.rows.ranges))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # the whole width on this rank
        return add_norm_for(x.device)(x, None, self.weight, None, self.eps, True, False)[0]

    def scale(self, x: torch.Tensor, sum_of_squares: torch.Tensor) -> torch.Tensor:
        """x normed by the whole width's sum of squares (fp32, [num_tokens, 1])."""
        rms = torch.rsqrt(sum_of_squares / self.rows.size + self.eps)
        return (x.float() * rms).to(x.dtype) * self.weight


class Olmo2Attention(LlamaAttention):
    def __init__(
        self, config, rotary: RotaryEmbedding, sliding_window: int, tp: TensorParallel
    ) -> None:
        super().__init__(config, rotary, sliding_window, tp)
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = self.q_size * tp.size // num_heads
        q, k, _ = head_shard(num_heads, num_kv_heads, head_dim, tp).sections
        self.q_norm = WidthNorm(q, config.rms_norm_eps)
        self.k_norm = WidthNorm(k, config.rms_norm_eps)
        self.tp = tp
        # Ranks may hold copies of a kv head (fewer kv heads than ranks, or a group split
        # between two): each of the checkpoint's kv heads is held this many times.
        group, local_heads = num_heads // num_kv_heads, num_heads // tp.size
        self.kv_copies = group // math.gcd(group, local_heads)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tp.size == 1:
            return self.q_norm(q), self.k_norm(k)
        k_squares = k.float().pow(2).sum(-1, keepdim=True) / self.kv_copies
        squares = torch.cat([q.float().pow(2).sum(-1, keepdim=True), k_squares], dim=-1)
        squares = self.tp.all_reduce(squares)  # [num_tokens, 2]: the whole widths'
        return self.q_norm.scale(q, squares[:, :1]), self.k_norm.scale(k, squares[:, 1:])

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.norm_qk(q, k)
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


class Olmo2ForCausalLM(LlamaForCausalLM):  # and OLMo 3
    def make_layers(self, config) -> list[nn.Module]:
        local, self.rotary = (
            rotary_of(config, kind) for kind in ("sliding_attention", "full_attention")
        )
        if (local.theta, local.scaling) == (self.rotary.theta, self.rotary.scaling):
            local = self.rotary  # one table (OLMo 2: the same settings everywhere)
        return [
            Olmo2DecoderLayer(config, local if window else self.rotary, window, self.tp)
            for window in layer_sliding_windows(config)
        ]


class OlmoAttention(LlamaAttention):
    """Llama's attention with q, k and v clamped to +-clip_qkv (where set)."""

    def __init__(self, config, rotary: RotaryEmbedding, tp: TensorParallel) -> None:
        super().__init__(config, rotary, 0, tp)
        self.clip_qkv = config.clip_qkv

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor | Fp8Rows, meta: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attend(positions, q, k, v, meta))


class OlmoForCausalLM(LlamaForCausalLM):
    def make_norm(self, config) -> nn.Module:
        return LayerNorm(config.hidden_size, 1e-5, bias=False)  # its weight set to ones

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        """The checkpoint's tensors, then every norm's weight ones: OLMo's LayerNorms
        have none."""
        loaded = super().load_weights(weights)
        for name, module in self.named_modules():
            if isinstance(module, AddNorm):
                module.weight.data.fill_(1.0)
                loaded.add(f"{name}.weight")
        return loaded

    def make_layers(self, config) -> list[nn.Module]:
        self.rotary = rotary_of(config)
        return [
            LlamaDecoderLayer(
                config,
                self.rotary,
                0,
                self.make_mlp(config, i),
                self.tp,
                self_attn=OlmoAttention(config, self.rotary, self.tp),
                norm=partial(self.make_norm, config),
            )
            for i in range(config.num_hidden_layers)
        ]


class OlmoeForCausalLM(MoeForCausalLM):
    def __init__(self, config, tp: TensorParallel = SINGLE) -> None:
        if getattr(config, "clip_qkv", None) is not None:
            raise ValueError(f"unsupported clip_qkv {config.clip_qkv} (q, k and v clamped)")
        super().__init__(config, tp)

    def make_layers(self, config) -> list[nn.Module]:
        head_dim = config.hidden_size // config.num_attention_heads
        self.rotary = rotary_of(config, head_dim=head_dim)
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
