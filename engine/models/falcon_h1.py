"""TII Falcon-H1 (`falcon_h1`): every layer a Mamba-2 mixer (mamba2.py) and Llama's attention
side by side on the same normed input, their outputs summed into the residual stream, then
a SwiGLU MLP. Its µP multipliers (on the embeddings, the LM head, each side's input and
output, the keys, the MLP's gate and down projection, and the mixer's in_proj by section)
are folded into the weights as they load, so the layers run as they would without them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import ClassVar

import torch
from torch import nn

from engine.distributed import TensorParallel
from engine.models.layers import AttentionMetadata
from engine.models.llama import FUSED, LlamaAttention, LlamaForCausalLM, LlamaMLP
from engine.models.mamba2 import IN_PROJ_FUSED, Mamba2Mixer, Mamba2Shape, split_in_proj
from engine.models.parallel import WeightSlice
from engine.models.rope import RotaryEmbedding, rotary_of

RENAMES = {
    ".feed_forward.": ".mlp.",
    ".pre_ff_layernorm.": ".post_attention_layernorm.",
    "model.final_layernorm.": "model.norm.",
    ".mamba.norm.weight": ".mamba.norm_weight",
}


class Scaled:
    """A checkpoint tensor read times `scale`, and its rows times `rows` where given (a
    multiplier per output row); in fp32, as the weight it fills is cast after."""

    def __init__(self, weight: WeightSlice, scale: float, rows: torch.Tensor | None = None):
        self.weight, self.scale, self.rows = weight, scale, rows

    def get_shape(self) -> list[int]:
        return self.weight.get_shape()

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        t = self.weight[index].float() * self.scale
        if self.rows is not None:
            rows = self.rows[index[0]]
            t = t * (rows[:, None] if t.dim() == 2 else rows)
        return t


def mixer_row_multipliers(config) -> torch.Tensor:
    """transformers' `mup_vector`: in_proj's rows by section (z, x, B, C, dt)."""
    inner = config.mamba_d_head * config.mamba_n_heads
    bc = config.mamba_n_groups * config.mamba_d_state
    sizes = (inner, inner, bc, bc, config.mamba_n_heads)
    return torch.cat([torch.full((n,), float(m)) for n, m in zip(sizes, config.ssm_multipliers)])


def multipliers(config, name: str, leaf: str) -> tuple[float, torch.Tensor | None] | None:
    """(scale, rows) folding a µP multiplier into checkpoint tensor `name` (a weight or a
    bias: `leaf`), or None where none applies. An input multiplier scales weights only."""
    weight = leaf == "weight"
    gate, down = config.mlp_multipliers
    attn_in = config.attention_in_multiplier if weight else 1.0
    table = {
        "embed_tokens": config.embedding_multiplier,
        "lm_head": config.lm_head_multiplier,
        "mamba.out_proj": config.ssm_out_multiplier,
        "self_attn.q_proj": attn_in,
        "self_attn.k_proj": attn_in * config.key_multiplier,
        "self_attn.v_proj": attn_in,
        "self_attn.o_proj": config.attention_out_multiplier,
        "mlp.gate_proj": gate,
        "mlp.down_proj": down,
    }
    if name.endswith("mamba.in_proj"):
        return (config.ssm_in_multiplier if weight else 1.0), mixer_row_multipliers(config)
    for suffix, scale in table.items():
        if name.endswith(suffix):
            return (scale, None) if scale != 1.0 else None
    return None


class FalconH1Layer(nn.Module):
    """norm, then mixer(h) + attention(h) into the residual stream; norm, then the MLP."""

    # The first norm feeds the mixer's in_proj and the attention's qkv_proj both.
    FP8_FEEDS: ClassVar[dict[str, str | tuple[str, ...]]] = {
        "input_layernorm": ("mamba.in_proj", "self_attn.qkv_proj"),
        "post_attention_layernorm": "mlp.gate_up_proj",
    }

    def __init__(
        self,
        config,
        rotary: RotaryEmbedding,
        make_norm: Callable[[], nn.Module],
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        self.input_layernorm = make_norm()
        self.mamba = Mamba2Mixer(config, Mamba2Shape.falcon_h1(config), tp)
        self.self_attn = LlamaAttention(config, rotary, 0, tp)
        self.post_attention_layernorm = make_norm()
        self.mlp = LlamaMLP(config, tp)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        mixed = self.mamba(positions, h, meta) + self.self_attn(positions, h, meta)
        h, residual = self.post_attention_layernorm(mixed, residual)
        return self.mlp(h), residual


class FalconH1ForCausalLM(LlamaForCausalLM):
    FUSED: ClassVar[dict[str, tuple[str, int]]] = FUSED | IN_PROJ_FUSED
    LORA_FUSED = None  # adapters on the mixers' projections are not wired

    @staticmethod
    def check_config(config) -> None:
        LlamaForCausalLM.check_config(config)
        tied = getattr(config, "tie_word_embeddings", False)
        if tied and config.embedding_multiplier != config.lm_head_multiplier:
            raise ValueError("tied embeddings with different embedding and lm_head multipliers")

    @staticmethod
    def recurrent(config) -> bool:  # EngineConfig.recurrent_model
        return True

    def make_layers(self, config) -> list[nn.Module]:
        self.rotary = rotary_of(config)
        return [
            FalconH1Layer(config, self.rotary, lambda: self.make_norm(config), self.tp)
            for _ in range(config.num_hidden_layers)
        ]

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        def ours() -> Iterator[tuple[str, WeightSlice]]:
            for name, weight in weights:
                for old, new in RENAMES.items():
                    name = name.replace(old, new)
                module, _, leaf = name.rpartition(".")
                fold = multipliers(self.config, module, leaf)
                if fold is not None:
                    weight = Scaled(weight, *fold)
                yield from split_in_proj(name, weight)

        return super().load_weights(ours())
