"""ModernBERT encoders: embedding models (gte-modernbert, modernbert-embed) and their
sequence classifiers (gte-reranker-modernbert), served as engine/models/bert.py's
encoders are (whole prompts, bidirectional attention, pooled outputs).

Pre-norm layers without biases (the first takes the normed embeddings as they are),
rotary positions with a base per layer kind, every `global_attn_every_n_layers`-th
layer global and the rest local: a query sees the keys at most `sliding_window` (half
of `local_attention`) positions away on either side. The MLP is a GeGLU.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.distributed import SINGLE, TensorParallel
from engine.models.bert import ClassifierHead, Encoder
from engine.models.gpt2 import ACTIVATIONS
from engine.models.layers import AddNorm, AttentionMetadata, PagedAttention
from engine.models.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    WeightSlice,
    head_shard,
    load_weight,
    split,
)
from engine.models.rope import RotaryEmbedding, rotary_of

# HF module names -> ours, after the "model." prefix a classifier's checkpoint has.
RENAMES = (
    ("embeddings.tok_embeddings", "tok_embeddings"),
    ("embeddings.norm", "emb_norm"),
    (".attn.Wqkv", ".qkv"),
    (".attn.Wo", ".attn_out"),
    (".mlp.Wi", ".up"),
    (".mlp.Wo", ".down"),
    ("head.", "classifier."),  # the classifier's dense + act + norm
)


class ModernBertLayer(nn.Module):
    def __init__(self, config, index: int, rotary: RotaryEmbedding, tp: TensorParallel) -> None:
        super().__init__()
        d, n = config.hidden_size, config.num_attention_heads
        head_dim = d // n
        heads = head_shard(n, n, head_dim, tp)
        bias, eps = config.norm_bias, config.norm_eps
        # The first layer reads the normed embeddings: no norm of its own.
        self.attn_norm = AddNorm(d, eps, rms=False, bias=bias) if index else None
        self.qkv = ColumnParallelLinear(d, heads.sections, bias=config.attention_bias)
        window = config.sliding_window if config.layer_types[index] == "sliding_attention" else 0
        self.attn = PagedAttention(
            heads.num_heads, heads.num_kv_heads, head_dim, head_dim**-0.5, window, causal=False
        )
        self.rotary = rotary
        self.attn_out = RowParallelLinear(d, d, bias=config.attention_bias, tp=tp)
        self.mlp_norm = AddNorm(d, eps, rms=False, bias=bias)
        inter = split(config.intermediate_size, tp, "intermediate_size")
        self.up = ColumnParallelLinear(d, [inter, inter], bias=config.mlp_bias)
        self.down = RowParallelLinear(config.intermediate_size, d, bias=config.mlp_bias, tp=tp)
        self.act = ACTIVATIONS[config.hidden_activation]

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the last MLP's output, not yet added to the residual stream (the first
        layer's: the normed embeddings, which are the stream)."""
        if self.attn_norm is not None:
            x, residual = self.attn_norm(x, residual)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        attended = self.attn(q, k, v, meta, self.rotary.rope(positions))
        h, residual = self.mlp_norm(self.attn_out(attended), residual)
        gelu_in, gate = self.up(h).chunk(2, dim=-1)
        return self.down(self.act(gelu_in) * gate), residual


class ModernBertModel(Encoder):
    """The encoder, and where the config's architecture is a *ForSequenceClassification,
    its head (`classifier`: dense, activation, norm, then the labels' projection)."""

    def __init__(self, config, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if config.hidden_activation not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_activation {config.hidden_activation!r}")
        self.config = config
        d, eps = config.hidden_size, config.norm_eps
        head_dim = d // config.num_attention_heads
        self.tok_embeddings = VocabParallelEmbedding(config.vocab_size, d, tp)
        self.emb_norm = AddNorm(d, eps, rms=False, bias=config.norm_bias)
        self.rotary_global, self.rotary_local = (
            rotary_of(config, kind, head_dim) for kind in ("full_attention", "sliding_attention")
        )
        rotaries = {"sliding_attention": self.rotary_local, "full_attention": self.rotary_global}
        self.layers = nn.ModuleList(
            ModernBertLayer(config, i, rotaries[kind], tp)
            for i, kind in enumerate(config.layer_types)
        )
        self.final_norm = AddNorm(d, eps, rms=False, bias=config.norm_bias)
        self.vocab_size = config.vocab_size
        architectures = getattr(config, "architectures", None) or []
        self.classifier = None
        if any(a.endswith("ForSequenceClassification") for a in architectures):
            act = ACTIVATIONS[config.classifier_activation]
            norm = nn.LayerNorm(d, eps=eps, bias=config.norm_bias)
            self.classifier = ClassifierHead(
                d, config.num_labels, dense_bias=config.classifier_bias, act=act, norm=norm
            )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        x = residual = self.emb_norm(self.tok_embeddings(input_ids))[0]
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        return self.final_norm(x, residual)[0]

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, weight in weights:
            ours = name.removeprefix("model.")
            if ours.startswith("decoder.") or (ours.startswith("head.") and not self.classifier):
                continue  # the masked-LM head
            for old, new in RENAMES:
                ours = ours.replace(old, new)
            if ours.startswith("classifier.") and ours.count(".") == 1:  # the projection
                ours = "classifier.out." + ours.removeprefix("classifier.")
            if ours not in params:
                raise ValueError(f"unexpected weight {name!r}")
            module, _, leaf = ours.rpartition(".")
            load_weight(self.get_submodule(module), leaf, weight, name)
            loaded.add(ours)
        return loaded
