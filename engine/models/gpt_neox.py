"""GPT-NeoX-shaped models: LayerNorms and a plain MLP; attention and MLP in parallel
(reading the same residual stream, their outputs joining it together) or in sequence:

- GPT-NeoX (`gpt_neox`: Pythia, GPT-NeoX-20B, and the models trained on its code):
  Llama's attention with biases, a partial rotary embedding, and the q, k and v rows
  interleaved head by head in one checkpoint tensor; a LayerNorm before each sublayer;
  a plain GELU MLP; `use_parallel_residual` (Pythia's) or the sequential layout.
- Phi (`phi`: phi-1, phi-1.5, phi-2): one LayerNorm both sublayers read, separate q/k/v
  tensors, a partial rotary embedding, and an LM head with a bias.
- StarCoder2 (`starcoder2`): the sequential layout with separate q/k/v tensors (GQA),
  biases where `use_bias`, the whole head rotated, a sliding window on every layer.
- GPT-J (`gptj`): Phi's layer without attention biases, the rotation on interleaved
  pairs (reordered at load) of each head's first rotary_dim dims.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from engine.distributed import SINGLE, TensorParallel
from engine.models.gpt2 import ACTIVATIONS, heads_in_sections
from engine.models.layers import AttentionMetadata, LayerNorm
from engine.models.llama import AttentionOptions, LlamaAttention, LlamaForCausalLM
from engine.models.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorSlice,
    WeightSlice,
    load_weight,
    split,
)
from engine.models.rope import RotaryEmbedding, interleaved_dim_order, rotary_of
from kernels.fp8 import Fp8Rows

# HF module names (under gpt_neox.) -> ours.
RENAMES = {
    "embed_in": "embed_tokens",
    "embed_out": "lm_head",
    "final_layer_norm": "norm",
    "attention.query_key_value": "self_attn.qkv_proj",
    "attention.dense": "self_attn.o_proj",
    "mlp.dense_h_to_4h": "mlp.up",
    "mlp.dense_4h_to_h": "mlp.down",
}
# Phi's (under model.) -> ours; its q/k/v tensors fill the qkv_proj's sections.
PHI_RENAMES = {
    "final_layernorm": "norm",
    "self_attn.dense": "self_attn.o_proj",
    "mlp.fc1": "mlp.up",
    "mlp.fc2": "mlp.down",
}
STARCODER2_RENAMES = {"mlp.c_fc": "mlp.up", "mlp.c_proj": "mlp.down"}
# GPT-J's (under transformer., its h. as layers.) -> ours.
GPTJ_RENAMES = {
    "wte.": "embed_tokens.",
    "ln_1.": "input_layernorm.",
    ".attn.": ".self_attn.",
    "out_proj": "o_proj",
    "mlp.fc_in": "mlp.up",
    "mlp.fc_out": "mlp.down",
    "ln_f.": "norm.",
}
QKV = ("q_proj", "k_proj", "v_proj")
IGNORED = ("rotary_emb.inv_freq", "attention.bias", "attention.masked_bias")
GPTJ_IGNORED = (".attn.bias", ".attn.masked_bias", "embed_positions")
# The config field naming the MLP's activation, where it is not hidden_act.
ACTIVATION_FIELDS = {"gptj": "activation_function", "opt": "activation_function"}
ACTIVATION_FIELDS["falcon"] = "activation"


class NeoXMLP(nn.Module):
    """down(act(up(x))): up column-parallel, down row-parallel."""

    def __init__(self, config, tp: TensorParallel) -> None:
        super().__init__()
        shape = MlpShape.of(config)
        inner = split(shape.size, tp, "mlp size")
        self.up = ColumnParallelLinear(config.hidden_size, [inner], bias=shape.bias)
        self.down = RowParallelLinear(shape.size, config.hidden_size, shape.bias, tp)
        self.act = ACTIVATIONS[shape.act]

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class NeoXLayer(nn.Module):
    """parallel: attention and MLP read the same stream (each through its own norm, or
    through the one norm when `shared_norm`, Phi's); else one after the other."""

    FP8_FEEDS: ClassVar[dict[str, str]] = {
        "input_layernorm": "self_attn.qkv_proj",
        "post_attention_layernorm": "mlp.up",
    }

    def __init__(
        self,
        config,
        rotary: RotaryEmbedding,
        tp: TensorParallel,
        parallel: bool,
        attention: AttentionOptions,
        shared_norm: bool = False,
        sliding_window: int = 0,
    ) -> None:
        super().__init__()
        eps = layer_norm_eps(config)
        self.parallel = parallel
        self.input_layernorm = LayerNorm(config.hidden_size, eps)
        self.self_attn = LlamaAttention(config, rotary, sliding_window, tp, attention)
        self.post_attention_layernorm = None if shared_norm else LayerNorm(config.hidden_size, eps)
        self.mlp = NeoXMLP(config, tp)
        if shared_norm:  # one norm, two readers: each FP8 projection quantizes its own input
            self.FP8_FEEDS = {}

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the last layer's output, not yet added to the residual stream."""
        h, residual = self.input_layernorm(x, residual)
        attn = self.self_attn(positions, h, meta)
        if self.post_attention_layernorm is None:  # both read the one norm
            return attn + self.mlp(h), residual
        if self.parallel:  # the MLP reads the stream as the attention did
            h, _ = self.post_attention_layernorm(residual)
            return attn + self.mlp(h), residual
        h, residual = self.post_attention_layernorm(attn, residual)
        return self.mlp(h), residual


def layer_norm_eps(config) -> float:
    if config.model_type == "opt":
        return 1e-5  # nn.LayerNorm's default, which OPT keeps
    if config.model_type in ("gptj", "falcon"):
        return config.layer_norm_epsilon
    return getattr(config, "layer_norm_eps", None) or config.norm_epsilon  # StarCoder2's name


@dataclass(frozen=True)
class MlpShape:
    """The MLP's width, activation and biases, read from each family's names for them."""

    size: int
    act: str
    bias: bool

    @staticmethod
    def of(config) -> MlpShape:
        if config.model_type == "gptj":  # GPT-2's names
            size = config.n_inner or 4 * config.hidden_size
            return MlpShape(size, config.activation_function, True)
        if config.model_type == "opt":
            return MlpShape(config.ffn_dim, config.activation_function, config.enable_bias)
        if config.model_type == "falcon":
            return MlpShape(config.ffn_hidden_size, config.activation, config.bias)
        # StarCoder2's use_bias; the others always have biases.
        bias = getattr(config, "use_bias", True)
        return MlpShape(config.intermediate_size, config.hidden_act, bias)


def check_neox_config(config) -> None:
    if (act := MlpShape.of(config).act) not in ACTIVATIONS:
        field = ACTIVATION_FIELDS.get(config.model_type, "hidden_act")
        raise ValueError(f"unsupported {field} {act!r}")


class GPTNeoXForCausalLM(LlamaForCausalLM):
    """llama.py's model with these layers, LayerNorms and its own checkpoint names."""

    check_config = staticmethod(check_neox_config)
    LORA_FUSED = None  # q/k/v interleaved head by head in one tensor; its own names
    RENAMES = RENAMES

    def attention(self, config) -> AttentionOptions:
        # A num_key_value_heads in the file is not NeoX's (nor transformers').
        return AttentionOptions(num_kv_heads=config.num_attention_heads)

    def make_layers(self, config) -> list[nn.Module]:
        head_dim = config.hidden_size // config.num_attention_heads
        self.rotary = rotary_of(config, head_dim=head_dim)
        return [self.make_layer(config, self.tp) for _ in range(config.num_hidden_layers)]

    def make_layer(self, config, tp: TensorParallel) -> NeoXLayer:
        return NeoXLayer(
            config, self.rotary, tp, config.use_parallel_residual, self.attention(config)
        )

    def make_norm(self, config) -> nn.Module:
        return LayerNorm(config.hidden_size, layer_norm_eps(config))

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        """Read this rank's part of each checkpoint tensor; returns our parameter names
        that were filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, weight in weights:
            if name.endswith(IGNORED):
                continue
            ours = name.removeprefix("gpt_neox.").removeprefix("model.")
            for theirs, renamed in self.RENAMES.items():
                ours = ours.replace(theirs, renamed)
            section = None
            module, _, leaf = ours.rpartition(".")
            proj = module.rpartition(".")[2]
            if proj in QKV:  # Phi's separate q, k and v
                ours, section = f"{module.removesuffix(proj)}qkv_proj.{leaf}", QKV.index(proj)
            if ours == "embed_tokens.weight" and self.tie_word_embeddings:
                load_weight(self.lm_head, "weight", weight, name)
                loaded.add("lm_head.weight")
            if ours == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if ours not in params:
                raise ValueError(f"unexpected weight {name!r}")
            if ".qkv_proj." in ours and section is None:  # NeoX's interleaved tensor
                weight = TensorSlice(self._qkv_in_sections(weight))
            module, _, leaf = ours.rpartition(".")
            load_weight(self.get_submodule(module), leaf, weight, name, section)
            loaded.add(ours if section is None else f"{ours}#{section}")
        for ours in {k.split("#")[0] for k in loaded if "#" in k}:
            if all(f"{ours}#{i}" in loaded for i in range(3)):
                loaded.add(ours)
        for layer in self.layers:
            layer.self_attn.reorder_rotary_dims()
        return loaded

    def _qkv_in_sections(self, weight: WeightSlice) -> torch.Tensor:
        """query_key_value's rows, [head 0's q, k, v, head 1's ...], as q, k, v sections."""
        config = self.config
        heads, hidden = config.num_attention_heads, config.hidden_size
        shape = weight.get_shape()
        if shape[0] != 3 * hidden:
            raise ValueError(f"shape {tuple(shape)}, expected ({3 * hidden}, ...)")
        return heads_in_sections(weight, heads)


class PhiForCausalLM(GPTNeoXForCausalLM):
    HEAD_BIAS = True
    RENAMES = PHI_RENAMES

    def __init__(self, config, tp: TensorParallel = SINGLE) -> None:
        if getattr(config, "qk_layernorm", False):
            raise ValueError("unsupported qk_layernorm=True")
        super().__init__(config, tp)

    def attention(self, config) -> AttentionOptions:
        # Its num_key_value_heads holds; q/k/v and dense always carry biases.
        return AttentionOptions(qkv_bias=True, o_bias=True)

    def make_layer(self, config, tp: TensorParallel) -> NeoXLayer:
        attention = self.attention(config)
        return NeoXLayer(config, self.rotary, tp, True, attention, shared_norm=True)


class Starcoder2ForCausalLM(GPTNeoXForCausalLM):
    RENAMES = STARCODER2_RENAMES

    def attention(self, config) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.use_bias, o_bias=config.use_bias)

    def make_layer(self, config, tp: TensorParallel) -> NeoXLayer:
        window = config.sliding_window or 0
        return NeoXLayer(config, self.rotary, tp, False, self.attention(config), False, window)


class GPTJForCausalLM(PhiForCausalLM):
    """GPT-J (`gptj`): Phi's layer (one LayerNorm both sublayers read) without attention
    biases, the rotation on interleaved pairs of the first rotary_dim dims of each head
    (reordered at load, as GLM's), and its own checkpoint names."""

    RENAMES = GPTJ_RENAMES

    def attention(self, config) -> AttentionOptions:
        return AttentionOptions(config.num_attention_heads, qkv_bias=False, o_bias=False)

    def make_layers(self, config) -> list[nn.Module]:
        head_dim = config.hidden_size // config.num_attention_heads
        rotary_dim = config.rotary_dim or head_dim
        partial = {"rope_type": "default", "partial_rotary_factor": rotary_dim / head_dim}
        self.rotary = RotaryEmbedding(head_dim, config.max_position_embeddings, 10000.0, partial)
        self.rotary.dim_order = interleaved_dim_order(head_dim, rotary_dim)
        return [self.make_layer(config, self.tp) for _ in range(config.num_hidden_layers)]

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        named = ((from_transformer(n), w) for n, w in weights if not n.endswith(GPTJ_IGNORED))
        return super().load_weights(named)


def from_transformer(name: str) -> str:
    """A GPT-2-style checkpoint name as the Llama-style ones: transformer.h.N. as
    layers.N., the other transformer. names without it (GPT-J's, Falcon's)."""
    return re.sub(r"^transformer\.(h\.)?", lambda m: m[1] and "layers.", name)
