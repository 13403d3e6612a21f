"""Llama-shaped dense models: Llama 2/3 (incl. llama3 rope scaling), Qwen2 (qkv bias, tied
head, use_sliding_window), Qwen3 (per-head q/k RMSNorm), Mistral (sliding window) and
Phi-3 (fused qkv/gate_up tensors, longrope). The MoE models (moe.py) reuse the attention."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch
from torch import nn

from engine.distributed import SINGLE, TensorParallel
from engine.images import ImageRows
from engine.models.layers import (
    AddNorm,
    AttentionMetadata,
    LMHead,
    PagedAttention,
    RMSNorm,
    layer_sliding_windows,
)
from engine.models.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    WeightSlice,
    head_shard,
    load_weight,
    permute_rows_,
    read,
    split,
)
from engine.models.rope import HeadNorm, RotaryEmbedding, rope_settings, rotary_of
from engine.models.weight_copy import fill
from kernels.activation import act_and_mul_for
from kernels.fp8 import Fp8Rows
from kernels.splits import summed

# HF projection -> (our fused parameter, section). q/k/v become one qkv_proj and gate/up
# one gate_up_proj, so each layer runs two GEMMs fewer (Phi-3 ships them fused).
FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


QK_NORM_MODELS = ("qwen3", "qwen3_moe", "gemma3_text", "exaone4", "exaone_moe", "dots1")
QK_NORM_MODELS += ("qwen3_vl_text", "qwen3_vl_moe_text", "apertus", "afmoe")
QK_NORM_MODELS += ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "lfm2", "lfm2_moe")
QKV_BIAS_MODELS = ("qwen2", "qwen2_vl_text", "qwen2_5_vl_text")  # always, as Qwen2's
SINK_MODELS = ("gpt_oss", "granite_swa", "granitemoe_swa")  # a sink logit per head
# The Llama-shaped models whose transformers code applies a partial_rotary_factor.
PARTIAL_ROTARY_MODELS = ("phi3", "glm4_moe", "glm4", "glm", "minimax_m2", "nemotron", "stablelm")
PARTIAL_ROTARY_MODELS += ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "bamba")


def check_config(config, act: str = "silu", mlp_bias: bool = False) -> None:
    """Raise ValueError naming a config feature this code would silently ignore."""
    if getattr(config, "hidden_act", act) != act:
        raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (only {act})")
    if getattr(config, "mlp_bias", False) and not mlp_bias:
        raise ValueError("unsupported mlp_bias=True")
    partial = (rope_settings(config)[1] or {}).get("partial_rotary_factor", 1.0)
    if partial != 1.0 and config.model_type not in PARTIAL_ROTARY_MODELS:
        raise ValueError(f"unsupported partial_rotary_factor {partial} (Phi-3's, GLM-4.5's)")


@dataclass(frozen=True)
class AttentionOptions:
    """What a family's attention has whatever its config says (None: the config's)."""

    num_kv_heads: int | None = None
    qkv_bias: bool | None = None
    o_bias: bool | None = None
    causal: bool = True  # False: attention both ways (EmbeddingGemma's)


class LlamaAttention(nn.Module):
    """Column-parallel qkv (this rank's q heads and the kv heads they read), row-parallel
    o_proj; the per-head q/k norms need no split."""

    def __init__(
        self,
        config,
        rotary: RotaryEmbedding | None,  # None: no position encoding (SmolLM3's NoPE layers)
        sliding_window: int,
        tp: TensorParallel = SINGLE,
        options: AttentionOptions = AttentionOptions(),
    ) -> None:
        super().__init__()
        num_heads = config.num_attention_heads
        num_kv_heads = options.num_kv_heads or getattr(config, "num_key_value_heads", None)
        num_kv_heads = num_kv_heads or num_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        heads = head_shard(num_heads, num_kv_heads, head_dim, tp)
        self.q_size = heads.num_heads * head_dim
        self.kv_size = heads.num_kv_heads * head_dim
        # Qwen2 always has q/k/v biases, Qwen2-MoE with qkv_bias, Llama with attention_bias.
        bias = config.model_type in QKV_BIAS_MODELS or getattr(config, "qkv_bias", False)
        bias = bias or getattr(config, "attention_bias", False)
        bias = bias if options.qkv_bias is None else options.qkv_bias
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, heads.sections, bias=bias)
        # As transformers' o_proj: attention_bias's, or Seed-OSS's attention_out_bias.
        o_bias = getattr(config, "attention_out_bias", getattr(config, "attention_bias", False))
        o_bias = o_bias if options.o_bias is None else options.o_bias
        self.o_proj = RowParallelLinear(num_heads * head_dim, config.hidden_size, o_bias, tp)
        self.q_norm = self.k_norm = None
        if config.model_type in QK_NORM_MODELS or getattr(config, "use_qk_norm", False):
            eps = getattr(config, "rms_norm_eps", None) or config.norm_eps  # LFM2's name
            self.q_norm = HeadNorm(head_dim, eps)
            self.k_norm = HeadNorm(head_dim, eps)
        self.rotary = rotary  # one cos/sin cache shared by the layers of a kind
        scale = (getattr(config, "query_pre_attn_scalar", None) or head_dim) ** -0.5
        scale = getattr(config, "attention_multiplier", None) or scale  # Granite's
        softcap = getattr(config, "attn_logit_softcapping", None) or 0.0  # Gemma 2
        self.attn = PagedAttention(
            heads.num_heads, heads.num_kv_heads, head_dim, scale, sliding_window, softcap,
            causal=options.causal,
        )  # fmt: skip
        self.sinks = None  # GPT-OSS: a sink logit per q head in the softmax's denominator
        if config.model_type in SINK_MODELS:
            self.sink_heads = split(num_heads, tp, "num_attention_heads")
            self.sinks = nn.Parameter(torch.empty(heads.num_heads))

    def load_shard(self, leaf: str, weight: WeightSlice, section: None) -> None:
        """The sinks (its one tensor of its own): this rank's q heads'."""
        heads = self.sink_heads
        fill(self.sinks.data, read(weight, [heads.size], heads.ranges))

    @torch.no_grad()
    def reorder_rotary_dims(self) -> None:
        """With partial rotary, the loaded q and k rows (and their norms) put in the order
        the kernels rotate (RotaryEmbedding.dim_order); a no-op otherwise."""
        if self.rotary is None or self.rotary.dim_order is None:
            return
        order = torch.tensor(self.rotary.dim_order, device=self.qkv_proj.weight.device)
        q_k = self.q_size + self.kv_size  # this rank's q heads, then its k heads
        heads = torch.arange(0, q_k, len(order), device=order.device)
        permute_rows_(self.qkv_proj, slice(0, q_k), (heads[:, None] + order).flatten())
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:  # a head's weights, or every head's (a whole-width norm)
                heads_of = norm.weight.view(-1, len(order))
                heads_of.copy_(heads_of[:, order])

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor | Fp8Rows, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attend(positions, q, k, v, meta))

    def attend(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, this rank's heads * head_dim], before o_proj
        if self.rotary is not None:  # the q/k norms go with the rotation
            rope = self.rotary.rope(positions, self.q_norm, self.k_norm)
            return self.attn(q, k, v, meta, rope, self.sinks)
        if self.q_norm is not None:  # no position encoding (NoPE), normed all the same
            q, k = self.q_norm(q), self.k_norm(k)
        return self.attn(q, k, v, meta, None, self.sinks)


class LlamaMLP(nn.Module):
    """down(act(gate) * up): SwiGLU with the default silu; Gemma's GeGLU passes gelu_tanh
    (kernels/activation.py names them; one kernel on CUDA). gate_up column-parallel (this
    rank's gate rows, then its up rows), down row-parallel."""

    FP8_FEEDS: ClassVar[dict[str, str]] = {"": "down_proj"}  # quantize_model: see fp8_out

    def __init__(
        self,
        config,
        tp: TensorParallel = SINGLE,
        act: str = "silu",
        intermediate_size: int | None = None,  # None: the config's (a shared expert's own)
    ) -> None:
        super().__init__()
        self.act = act
        self.fp8_out = False  # the activation quantizes its rows for an FP8 down_proj
        size = intermediate_size or config.intermediate_size
        inter = split(size, tp, "intermediate_size")
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [inter, inter], bias=False)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=False, tp=tp)

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        h = self.gate_up_proj(x)
        return self.down_proj(act_and_mul_for(h.device)(h, self.act, self.fp8_out))


class LlamaDecoderLayer(nn.Module):
    # Norm -> the FP8 projection that alone reads it (quantize_model sets fp8_out).
    FP8_FEEDS: ClassVar[dict[str, str]] = {
        "input_layernorm": "self_attn.qkv_proj",
        "post_attention_layernorm": "mlp.gate_up_proj",
    }

    def __init__(
        self,
        config,
        rotary: RotaryEmbedding | None,
        sliding_window: int,
        mlp: nn.Module,
        tp: TensorParallel = SINGLE,
        attention: AttentionOptions = AttentionOptions(),
        self_attn: nn.Module | None = None,  # another attention (DeepSeek's MLA)
        norm: Callable[[], nn.Module] | None = None,  # None: RMSNorm
    ) -> None:
        super().__init__()
        norm = norm or partial(RMSNorm, config.hidden_size, config.rms_norm_eps)
        self.input_layernorm = norm()
        self.self_attn = self_attn or LlamaAttention(config, rotary, sliding_window, tp, attention)
        self.post_attention_layernorm = norm()
        self.mlp = mlp

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the last sublayer's output, not yet added to the residual stream."""
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(positions, h, meta), residual)
        return self.mlp(h), residual

    def sums_in_norms(self) -> bool:
        """Whether this forward hands its sublayers' outputs to its norms alone."""
        return (
            type(self).forward is LlamaDecoderLayer.forward
            and isinstance(self.input_layernorm, AddNorm)
            and isinstance(self.post_attention_layernorm, AddNorm)
        )

    def sum_in_norms(self) -> None:
        """Let o_proj and down_proj leave a split launch's splits unsummed for the residual
        adds after them (`RowParallelLinear.sum_later`): this forward hands o_proj's output
        to a norm alone, and the model's hands the MLP's to the next layer's or the last
        (every layer `sums_in_norms`)."""
        if type(self.self_attn) is LlamaAttention and isinstance(
            self.self_attn.o_proj, RowParallelLinear
        ):
            self.self_attn.o_proj.sum_later = True
        if type(self.mlp) is LlamaMLP and isinstance(self.mlp.down_proj, RowParallelLinear):
            self.mlp.down_proj.sum_later = True


class LlamaForCausalLM(nn.Module):
    check_config = staticmethod(check_config)
    # PEFT module name -> our fused projection and section, for LoRA adapters
    # (engine/models/lora.py); None: a family whose loading reorders rows LoRA's B holds.
    FUSED: ClassVar[dict[str, tuple[str, int]]] = FUSED  # what load_weights fuses
    LORA_FUSED: ClassVar[dict[str, tuple[str, int]] | None] = FUSED

    def __init__(self, config, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.check_config(config)
        self.config = config
        self.tp = tp
        self.tie_word_embeddings = getattr(config, "tie_word_embeddings", False)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(self.make_layers(config))
        self.norm = self.make_norm(config)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tp, bias=self.HEAD_BIAS)
        if (
            type(self).forward is LlamaForCausalLM.forward
            and isinstance(self.norm, AddNorm)
            and all(isinstance(layer, LlamaDecoderLayer) and layer.sums_in_norms()
                    for layer in self.layers)
        ):  # fmt: skip
            for layer in self.layers:
                layer.sum_in_norms()

    HEAD_BIAS = False  # an LM head with a bias (Phi's)
    ATTENTION = AttentionOptions()  # a family's attention settings its config leaves out

    def make_norm(self, config) -> nn.Module:
        return RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_layers(self, config) -> list[nn.Module]:
        self.rotary = rotary_of(config)
        windows = layer_sliding_windows(config)
        # SmolLM3 leaves the position encoding out of the layers no_rope_layers marks 0.
        ropes = getattr(config, "no_rope_layers", None) or [1] * config.num_hidden_layers
        return [
            LlamaDecoderLayer(
                config,
                self.rotary if ropes[i] else None,
                windows[i],
                self.make_mlp(config, i),
                self.tp,
                self.ATTENTION,
                norm=partial(self.make_norm, config),
            )
            for i in range(config.num_hidden_layers)
        ]

    def make_mlp(self, config, layer: int) -> nn.Module:
        return LlamaMLP(config, self.tp)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        images: ImageRows | None = None,  # image features in place of their placeholders
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        x, residual = self.embed(input_ids), None
        if images is not None:
            x = images.apply(x)
            if images.positions3 is not None:  # the Qwen VL models' 3-D image positions
                table = images.rope_table(self.rotary, positions)
                meta = dataclasses.replace(meta, rope_table=table)
        deepstack = None if images is None else images.deepstack
        if (q_scale := self.query_scale(positions)) is not None:  # once a step
            for layer in self.layers:
                layer.self_attn.q_scale = q_scale
        for i, layer in enumerate(self.layers):
            x, residual = layer(positions, x, residual, meta)
            if deepstack is not None and i < len(deepstack):  # Qwen3-VL's, at the image rows
                x = summed(x)
                x = x.index_put((images.rows,), deepstack[i].to(x.dtype), accumulate=True)
        return self.norm(x, residual)[0]

    def query_scale(self, positions: torch.Tensor) -> torch.Tensor | None:
        """The queries' scale by position [num_tokens, 1], the same in every layer that
        takes one (Llama 4's NoPE layers, Mistral 4's); None: no scale."""
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [num_seqs, vocab_size]

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        """Read this rank's part of each checkpoint tensor; returns our parameter names
        that were filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, weight in weights:
            name = name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "embed_tokens.weight" and self.tie_word_embeddings:
                load_weight(self.lm_head, "weight", weight, name)
                loaded.add("lm_head.weight")
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # the embedding's rows filled it
            module, _, leaf = name.rpartition(".")
            proj = module.rpartition(".")[2]
            fused, section = self.FUSED.get(proj, (proj, None))
            module = module.removesuffix(proj) + fused
            ours = f"{module}.{leaf}"
            if ours not in params:
                raise ValueError(f"unexpected weight {name!r}")
            load_weight(self.get_submodule(module), leaf, weight, name, section)
            loaded.add(ours if section is None else f"{ours}#{section}")
        # A fused parameter is loaded when all its sections are.
        for ours in {k.split("#")[0] for k in loaded if "#" in k}:
            sections = len(self.get_submodule(ours.rpartition(".")[0]).sections)
            if all(f"{ours}#{i}" in loaded for i in range(sections)):
                loaded.add(ours)
        for module in self.modules():  # each attention: rows in the kernels' rotary order
            if module is not self and hasattr(module, "reorder_rotary_dims"):
                module.reorder_rotary_dims()
        return loaded
