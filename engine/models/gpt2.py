"""GPT-2, reading and writing the paged KV cache."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.models.layers import (
    ACTIVATIONS,
    AttentionMetadata,
    DownProjection,
    LayerNorm,
    LMHead,
    PagedAttention,
)

# HF name suffix -> ours. HF stores GPT-2's projections as Conv1D ([in, out]),
# so those weights are transposed into nn.Linear's [out, in] on load.
TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")
IGNORED = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers in old checkpoints


class GPT2Block(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        d, heads = config.n_embd, config.n_head
        inner = config.n_inner or 4 * d
        self.ln_1 = LayerNorm(d, config.layer_norm_epsilon)
        self.c_attn = nn.Linear(d, 3 * d)
        self.attn = PagedAttention(heads, heads, d // heads, (d // heads) ** -0.5)
        self.c_proj = nn.Linear(d, d)
        self.ln_2 = LayerNorm(d, config.layer_norm_epsilon)
        self.c_fc = nn.Linear(d, inner)
        self.mlp_proj = DownProjection(inner, d)
        self.act = ACTIVATIONS[config.activation_function]
        self.tanh_gelu = config.activation_function in TANH_GELU

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the last sublayer's output, not yet added to the residual stream."""
        h, residual = self.ln_1(x, residual)
        q, k, v = self.c_attn(h).chunk(3, dim=-1)
        h, residual = self.ln_2(self.c_proj(self.attn(q, k, v, meta)), residual)
        return self.mlp_proj(self.mlp_in(h)), residual

    def mlp_in(self, h: torch.Tensor) -> torch.Tensor:
        if self.tanh_gelu and h.is_cuda and isinstance(self.c_fc, nn.Linear):  # not FP8
            # cuBLASLt's GELU epilogue is the tanh form: GEMM, bias and GELU in one
            # kernel (on CPU the same call computes erf GELU, hence CUDA only).
            return torch._addmm_activation(self.c_fc.bias, h, self.c_fc.weight.t(), use_gelu=True)
        return self.act(self.c_fc(h))


class GPT2ForCausalLM(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.max_positions = config.n_positions
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(GPT2Block(config) for _ in range(config.n_layer))
        self.ln_f = LayerNorm(config.n_embd, config.layer_norm_epsilon)
        self.lm_head = LMHead(config.vocab_size, config.n_embd)

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

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF tensors in; returns our parameter names that were filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("transformer.")
            if name.endswith(IGNORED):
                continue
            if name.endswith(TRANSPOSED):
                tensor = tensor.t()
            ours = (
                name.replace("attn.c_attn", "c_attn")
                .replace("attn.c_proj", "c_proj")
                .replace("mlp.c_fc", "c_fc")
                .replace("mlp.c_proj", "mlp_proj")
            )
            if ours == "wte.weight":
                self.lm_head.load(tensor)  # GPT-2 always ties its head
                loaded.add("lm_head.weight")
            if ours == "lm_head.weight":
                self.lm_head.load(tensor)
            elif ours in params:
                params[ours].data.copy_(tensor)
            else:
                raise ValueError(f"unexpected weight {name!r} for GPT-2")
            loaded.add(ours)
        return loaded
