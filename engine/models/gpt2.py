"""GPT-2, reading and writing the paged KV cache; GPT-BigCode (`gpt_bigcode`: StarCoder,
SantaCoder, WizardCoder): GPT-2's blocks with nn.Linear projections and, where
`multi_query`, one k/v head that every q head reads."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import SINGLE, TensorParallel
from engine.models.layers import AttentionMetadata, LayerNorm, LMHead, PagedAttention
from engine.models.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorSlice,
    Transposed,
    VocabParallelEmbedding,
    WeightSlice,
    head_shard,
    load_weight,
    split,
)
from kernels.fp8 import Fp8Rows
from kernels.linear import dense

# HF name suffix -> ours. HF stores GPT-2's projections as Conv1D ([in, out]),
# so those weights are read transposed into nn.Linear's [out, in].
TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")
ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu}
ACTIVATIONS |= dict.fromkeys(TANH_GELU, functools.partial(F.gelu, approximate="tanh"))
IGNORED = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers in old checkpoints


class GPT2Block(nn.Module):
    """Column-parallel c_attn (this rank's heads of q, k and v) and c_fc, row-parallel
    c_proj and mlp_proj."""

    FP8_FEEDS: ClassVar[dict[str, str]] = {"ln_1": "c_attn", "ln_2": "c_fc"}  # quantize_model

    def __init__(self, config, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        d, head_dim = config.n_embd, config.n_embd // config.n_head
        inner = config.n_inner or 4 * d
        num_kv_heads = 1 if getattr(config, "multi_query", False) else config.n_head
        heads = head_shard(config.n_head, num_kv_heads, head_dim, tp)
        self.qkv_sizes = [s.local_size for s in heads.sections]
        self.ln_1 = LayerNorm(d, config.layer_norm_epsilon)
        self.c_attn = ColumnParallelLinear(d, heads.sections, bias=True)
        self.attn = PagedAttention(heads.num_heads, heads.num_kv_heads, head_dim, head_dim**-0.5)
        self.c_proj = RowParallelLinear(d, d, bias=True, tp=tp)
        self.ln_2 = LayerNorm(d, config.layer_norm_epsilon)
        self.c_fc = ColumnParallelLinear(d, [split(inner, tp, "n_inner")], bias=True)
        self.mlp_proj = RowParallelLinear(inner, d, bias=True, tp=tp)
        self.act = ACTIVATIONS[config.activation_function]
        self.tanh_gelu = config.activation_function in TANH_GELU

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the last sublayer's output, not yet added to the residual stream."""
        h, residual = self.ln_1(x, residual)
        q, k, v = self.c_attn(h).split(self.qkv_sizes, dim=-1)
        h, residual = self.ln_2(self.c_proj(self.attn(q, k, v, meta)), residual)
        return self.mlp_proj(self.mlp_in(h)), residual

    def mlp_in(self, h: torch.Tensor | Fp8Rows) -> torch.Tensor:
        if self.tanh_gelu and isinstance(self.c_fc, nn.Linear) and h.is_cuda:  # not FP8
            # GEMM, bias and GELU in one kernel (cuBLASLt's epilogue is the tanh form; on
            # CPU the same call computes erf GELU, hence CUDA only).
            return dense(h, self.c_fc.weight, self.c_fc.bias, gelu=True)
        return self.act(self.c_fc(h))


def heads_in_sections(weight: WeightSlice, heads: int) -> torch.Tensor:
    """A fused qkv tensor's rows (or bias), [head 0's q, k, v, head 1's ...], as q, k, v
    sections (GPT-NeoX's query_key_value, multi-head GPT-BigCode's c_attn)."""
    shape = weight.get_shape()
    tensor = weight[tuple(slice(None) for _ in shape)]
    by_head = tensor.reshape(heads, 3, shape[0] // (3 * heads), *shape[1:])
    return by_head.transpose(0, 1).reshape(shape)


class GPT2ForCausalLM(nn.Module):
    TRANSPOSED = TRANSPOSED  # GPT-2's Conv1D weights

    def __init__(self, config, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if not config.scale_attn_weights or getattr(config, "scale_attn_by_inverse_layer_idx", 0):
            raise ValueError("unsupported attention scale (scale_attn_weights=False or by layer)")
        if config.activation_function not in ACTIVATIONS:
            raise ValueError(f"unsupported activation_function {config.activation_function!r}")
        self.config = config
        self.wte = VocabParallelEmbedding(config.vocab_size, config.n_embd, tp)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)  # replicated
        self.h = nn.ModuleList(GPT2Block(config, tp) for _ in range(config.n_layer))
        self.ln_f = LayerNorm(config.n_embd, config.layer_norm_epsilon)
        self.lm_head = LMHead(config.vocab_size, config.n_embd, tp=tp)
        stock = (type(block).forward is GPT2Block.forward for block in self.h)
        if type(self).forward is GPT2ForCausalLM.forward and all(stock):
            for block in self.h:  # each output goes to a norm alone (RowParallelLinear)
                block.c_proj.sum_later = block.mlp_proj.sum_later = True

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # [num_tokens, n_embd]
        # The first norm adds the two embeddings.
        x, residual = self.wte(input_ids), self.wpe(positions)
        for block in self.h:
            x, residual = block(x, residual, meta)
        return self.ln_f(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [num_seqs, vocab_size]

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        """Read this rank's part of each HF tensor; returns our parameter names filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        # Multi-head GPT-BigCode's c_attn holds its rows head by head.
        interleaved = self.config.model_type == "gpt_bigcode" and not self.config.multi_query
        for name, weight in weights:
            name = name.removeprefix("transformer.")
            if name.endswith(IGNORED):
                continue
            if name.endswith(self.TRANSPOSED):
                weight = Transposed(weight)
            if name.endswith((".c_attn.weight", ".c_attn.bias")) and interleaved:
                weight = TensorSlice(heads_in_sections(weight, self.config.n_head))
            ours = name.replace("mlp.c_proj", "mlp_proj").replace("attn.c_", "c_")
            ours = ours.replace("mlp.c_fc", "c_fc")
            if ours == "wte.weight":
                load_weight(self.lm_head, "weight", weight, name)  # GPT-2 always ties its head
                loaded.add("lm_head.weight")
            if ours in params:  # lm_head.weight too, where a checkpoint holds it
                module, _, leaf = ours.rpartition(".")
                load_weight(self.get_submodule(module), leaf, weight, name)
            else:
                raise ValueError(f"unexpected weight {name!r} for GPT-2")
            loaded.add(ours)
        return loaded


class GPTBigCodeForCausalLM(GPT2ForCausalLM):
    TRANSPOSED = ()  # nn.Linear's [out, in]
