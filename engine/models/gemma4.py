"""Gemma 4 text (Gemma4ForCausalLM, and Gemma4ForConditionalGeneration's language model):
Gemma 3's layers with plain-weight RMSNorms, per-head q/k norms and a weightless RMS norm
on each value head, attention scale 1, and each layer's output (residual included) times
its layer_scalar. The global (full-attention) layers have heads of their own size and
count (per_layer_config: global_head_dim, num_global_key_value_heads), rotate only the
first quarter of their frequency pairs (proportional rope) and, with attention_k_eq_v,
take V from the key projection. The 26B-A4B's layers add top-k GeGLU experts beside the
dense MLP (Gemma4MoE). Refused by name: E2B's and E4B's per-layer embeddings and KV
shared across layers."""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import ClassVar

import torch
from torch import nn

from engine.distributed import SINGLE, TensorParallel
from engine.models.experts import FusedMoE
from engine.models.gemma3 import Gemma3DecoderLayer, Gemma3ForCausalLM
from engine.models.layers import AttentionMetadata, RMSNorm, layer_sliding_windows
from engine.models.llama import LlamaAttention
from engine.models.moe import MoeForCausalLM
from engine.models.parallel import ColumnParallelLinear, WeightSlice, fill_rows, head_shard, read
from engine.models.rope import HeadNorm, RotaryEmbedding, rotary_of
from kernels.activation import GeluTanhGLU
from kernels.moe_routing import select_experts_for


def check_config(config) -> None:
    if getattr(config, "hidden_size_per_layer_input", None):
        raise ValueError(
            "unsupported hidden_size_per_layer_input (Gemma 4 E2B/E4B's per-layer embeddings)"
        )
    if getattr(config, "num_kv_shared_layers", 0):
        raise ValueError("unsupported num_kv_shared_layers (Gemma 4 E2B/E4B's shared KV)")
    if getattr(config, "use_bidirectional_attention", None) == "all":
        raise ValueError("unsupported use_bidirectional_attention='all'")
    if getattr(config, "hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"unsupported hidden_activation {config.hidden_activation!r}")


class Gemma4Attention(LlamaAttention):
    """Llama's attention with q/k norms and V normed per head without weights; a global
    layer with attention_k_eq_v projects K only and reads it, before its norm and
    rotation, as V."""

    def __init__(
        self,
        config,
        layer: int,
        rotary: RotaryEmbedding,
        sliding_window: int,
        tp: TensorParallel = SINGLE,
    ) -> None:
        shape = config.per_layer_config[layer]  # the config, with this kind's head size and count
        super().__init__(shape, rotary, sliding_window, tp)
        self.q_norm = HeadNorm(shape.head_dim, config.rms_norm_eps)
        self.k_norm = HeadNorm(shape.head_dim, config.rms_norm_eps)
        self.v_norm = HeadNorm(shape.head_dim, config.rms_norm_eps)  # weights: ones, at load
        self.attn.scale = 1.0  # the q/k norms stand for 1 / sqrt(head_dim)
        self.k_is_v = bool(getattr(config, "attention_k_eq_v", False)) and not sliding_window
        if self.k_is_v:
            heads = head_shard(
                config.num_attention_heads, shape.num_key_value_heads, shape.head_dim, tp
            )
            bias = getattr(config, "attention_bias", False)
            self.qkv_proj = ColumnParallelLinear(config.hidden_size, heads.sections[:2], bias=bias)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
        v = self.v_norm(k if self.k_is_v else qkv[:, self.q_size + self.kv_size :])
        return self.o_proj(self.attend(positions, q, k, v, meta))


class Gemma4MoE(FusedMoE):
    """The 26B-A4B's experts: routed from the residual stream, RMS-normed without weights
    and times `scale` and hidden_size ** -0.5, by a renormalized softmax top-k, each
    chosen expert's weight times its per_expert_scale; GeGLU experts."""

    def __init__(self, config, tp: TensorParallel) -> None:
        hidden, experts = config.hidden_size, config.num_experts
        inter, top_k = config.moe_intermediate_size, config.top_k_experts
        super().__init__(hidden, inter, experts, top_k, True, tp, act=GeluTanhGLU())
        self.scale = nn.Parameter(torch.empty(hidden))
        self.per_expert_scale = nn.Parameter(torch.empty(experts))
        self.root = hidden**-0.5
        self.eps = config.rms_norm_eps

    def load_shard(self, leaf: str, weight: WeightSlice, section: tuple | None) -> None:
        if leaf in ("scale", "per_expert_scale"):  # the router's, replicated
            fill_rows(self, leaf, slice(None), read(weight, getattr(self, leaf).shape))
        else:
            super().load_shard(leaf, weight, section)

    def forward(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual: what the router reads; x: what the experts read (normed)."""
        h = residual.float()
        h = (h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)).to(residual.dtype)
        route = select_experts_for(x.device)
        weights, ids = route(self.gate(h * self.scale * self.root), self.top_k, True)
        return self.routed(x, weights * self.per_expert_scale[ids], ids)


class Gemma4DecoderLayer(Gemma3DecoderLayer):
    def __init__(
        self,
        config,
        layer: int,
        rotary: RotaryEmbedding,
        sliding_window: int,
        tp: TensorParallel = SINGLE,
    ) -> None:
        attention = Gemma4Attention(config, layer, rotary, sliding_window, tp)
        super().__init__(config, rotary, sliding_window, tp, self_attn=attention)
        self.layer_scalar = nn.Parameter(torch.empty(1))
        self.moe = None
        if getattr(config, "enable_moe_block", False):
            self.moe = Gemma4MoE(config, tp)
            norm = partial(RMSNorm, config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm_1 = norm()
            self.pre_feedforward_layernorm_2 = norm()
            self.post_feedforward_layernorm_2 = norm()

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, residual = super().forward(positions, x, residual, meta)
        # The layer's sum times its scalar: both parts, before the next layer adds them.
        return out * self.layer_scalar, residual * self.layer_scalar

    def feed_forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        out = self.mlp(h)
        if self.moe is None:
            return out
        # The experts beside the MLP, reading the residual stream; each output normed.
        experts = self.moe(residual, self.pre_feedforward_layernorm_2(residual)[0])
        out = self.post_feedforward_layernorm_1(out)[0]
        return out + self.post_feedforward_layernorm_2(experts)[0]


class Gemma4ForCausalLM(Gemma3ForCausalLM, MoeForCausalLM):
    """Gemma 3's model; MoeForCausalLM's loading of stacked experts."""

    check_config = staticmethod(check_config)
    RENAMES: ClassVar[dict[str, str]] = {
        ".router.proj.": ".moe.gate.",
        ".router.": ".moe.",  # scale, per_expert_scale
        ".experts.": ".moe.experts.",  # read into the stack by MoeForCausalLM
    }
    LORA_FUSED: ClassVar[dict[str, tuple[str, int]] | None] = None  # global layers' own shapes

    def make_layers(self, config) -> list[nn.Module]:
        self.rotary_local, self.rotary_global = (
            rotary_of(config, kind, config.per_layer_config[kind].head_dim)
            for kind in ("sliding_attention", "full_attention")
        )
        windows = layer_sliding_windows(config)
        return [
            Gemma4DecoderLayer(
                config, i, self.rotary_local if w else self.rotary_global, w, self.tp
            )
            for i, w in enumerate(windows)
        ]

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        # Gemma 4's norms multiply by their weights: none is folded as Gemma 3's are.
        loaded = MoeForCausalLM.load_weights(self, weights)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            attn.v_norm.weight.data.fill_(1.0)
            loaded.add(f"layers.{i}.self_attn.v_norm.weight")
            qkv = f"layers.{i}.self_attn.qkv_proj.weight"
            if attn.k_is_v and {f"{qkv}#0", f"{qkv}#1"} <= loaded:  # its two sections
                loaded.add(qkv)
        return loaded
