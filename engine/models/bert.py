"""BERT, RoBERTa, XLM-RoBERTa and DistilBERT encoders: embedding models (bge, e5,
all-MiniLM, gte, bge-m3, msmarco-distilbert) and their sequence classifiers
(cross-encoders such as bge-reranker, sentiment classifiers).

An encoder attends both ways within its prompt, so each prompt runs whole in one step,
over the paged cache like any prefill (PagedAttention with causal=False), and nothing
of it is cached for another prompt (EngineConfig.encoder_only). Its outputs are pooled
(engine/pooling.py): it generates nothing, so its logits are zeros.

Token types (BERT's segment ids, which a cross-encoder's pair encoding sets to 1 on the
second text) travel packed into the prompt's ids (engine/checks.py's TOKEN_TYPE_SHIFT),
as vLLM packs them; the embedding unpacks them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from engine.checks import TOKEN_TYPE_SHIFT
from engine.distributed import SINGLE, TensorParallel
from engine.models.gpt2 import ACTIVATIONS
from engine.models.layers import AttentionMetadata, LayerNorm, PagedAttention
from engine.models.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    WeightSlice,
    head_shard,
    load_weight,
    split,
)

ENCODER_TYPES = ("bert", "roberta", "xlm-roberta", "distilbert", "modernbert")
# HF module path inside a layer -> ours (and the qkv section).
LAYER_NAMES = {
    "attention.self.query": ("qkv", 0),
    "attention.self.key": ("qkv", 1),
    "attention.self.value": ("qkv", 2),
    "attention.output.dense": ("attn_out", None),
    "attention.output.LayerNorm": ("attn_norm", None),
    "intermediate.dense": ("up", None),
    "output.dense": ("down", None),
    "output.LayerNorm": ("out_norm", None),
    # DistilBERT's names for the same
    "attention.q_lin": ("qkv", 0),
    "attention.k_lin": ("qkv", 1),
    "attention.v_lin": ("qkv", 2),
    "attention.out_lin": ("attn_out", None),
    "sa_layer_norm": ("attn_norm", None),
    "ffn.lin1": ("up", None),
    "ffn.lin2": ("down", None),
    "output_layer_norm": ("out_norm", None),
}
# Checkpoint tensors an encoder serving embeddings or scores never reads: the masked-LM
# and next-sentence heads, and old checkpoints' position-id buffers.
IGNORED_PREFIXES = ("cls.", "lm_head.")
IGNORED_SUFFIXES = ("position_ids",)


def is_encoder(config) -> bool:
    # EmbeddingGemma too: a Gemma 3 whose attention runs both ways (engine/models/gemma3.py)
    bidirectional = getattr(config, "use_bidirectional_attention", False)
    return config.model_type in ENCODER_TYPES or bool(bidirectional)


@dataclass(frozen=True)
class BertShape:
    """What the layers read of a config, whose names DistilBERT's differs in."""

    intermediate_size: int
    act: str
    eps: float
    type_vocab_size: int  # 0: no token type embeddings (DistilBERT)

    @classmethod
    def of(cls, config) -> BertShape:
        if config.model_type == "distilbert":  # its LayerNorms' eps is fixed in the code
            return cls(config.hidden_dim, config.activation, 1e-12, 0)
        eps, types = config.layer_norm_eps, config.type_vocab_size
        return cls(config.intermediate_size, config.hidden_act, eps, types)


def check_config(config) -> None:
    """Raise ValueError naming a config feature this code would silently ignore."""
    kind = getattr(config, "position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(f"unsupported position_embedding_type {kind!r} (only absolute)")
    if getattr(config, "is_decoder", False):
        raise ValueError("a BERT-family model configured as a decoder is not supported")
    act = BertShape.of(config).act
    if act not in ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {act!r}")


def position_offset(config) -> int:
    """RoBERTa numbers positions from padding_idx + 1 (transformers'
    create_position_ids_from_input_ids on an unpadded prompt); BERT and ModernBERT from 0."""
    return config.pad_token_id + 1 if config.model_type in ("roberta", "xlm-roberta") else 0


def token_types(config) -> int:
    """How many token types an encoder's prompt ids may carry (1: a decoder's, none)."""
    return getattr(config, "type_vocab_size", 1) if is_encoder(config) else 1


def encoder_max_len(config) -> int:
    return config.max_position_embeddings - position_offset(config)


class ClassifierHead(nn.Module):
    """A sequence classifier's head over its pooled state: dense, an activation (tanh)
    and a norm (none), then the labels' projection (BERT's pooler and classifier;
    RoBERTa's classification head; ModernBERT's head, GELU and a LayerNorm). A
    decoder's `score` is the projection alone, without bias (dense False)."""

    def __init__(
        self,
        hidden: int,
        num_labels: int,
        dense: bool = True,
        bias: bool = True,
        dense_bias: bool = True,
        act: Callable[[torch.Tensor], torch.Tensor] = torch.tanh,
        norm: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.num_labels = num_labels
        self.dense = nn.Linear(hidden, hidden, bias=dense_bias) if dense else None
        self.act = act
        self.norm = norm
        self.out = nn.Linear(hidden, num_labels, bias=bias)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:  # [n, num_labels] fp32
        x = pooled.to(self.out.weight.dtype)
        if self.dense is not None:
            x = self.act(self.dense(x))
            if self.norm is not None:
                x = self.norm(x)
        return self.out(x).float()


class BertLayer(nn.Module):
    """Post-norm: each sublayer's output is added to its input, then normalized."""

    def __init__(self, config, tp: TensorParallel) -> None:
        super().__init__()
        d, n, shape = config.hidden_size, config.num_attention_heads, BertShape.of(config)
        head_dim = d // n
        heads = head_shard(n, n, head_dim, tp)
        self.qkv = ColumnParallelLinear(d, heads.sections, bias=True)
        scale = head_dim**-0.5
        self.attn = PagedAttention(
            heads.num_heads, heads.num_kv_heads, head_dim, scale, causal=False
        )
        self.attn_out = RowParallelLinear(d, d, bias=True, tp=tp)
        self.attn_norm = LayerNorm(d, shape.eps)
        inter = shape.intermediate_size
        self.up = ColumnParallelLinear(d, [split(inter, tp, "intermediate_size")], bias=True)
        self.down = RowParallelLinear(inter, d, bias=True, tp=tp)
        self.out_norm = LayerNorm(d, shape.eps)
        self.act = ACTIVATIONS[shape.act]

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        h = self.attn_norm(self.attn_out(self.attn(q, k, v, meta)), x)[0]
        return self.out_norm(self.down(self.act(self.up(h))), h)[0]


class Encoder(nn.Module):
    """What every encoder model is to the engine: it pools, and generates nothing."""

    is_encoder = True
    has_lm_head = False
    vocab_size: int

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # The pooling rows' one token, sampled and dropped, is 0.
        return hidden.new_zeros(hidden.shape[0], self.vocab_size)


class BertModel(Encoder):
    """The encoder (BertModel, RobertaModel, XLMRobertaModel, DistilBertModel), and where
    the config's architecture is a *ForSequenceClassification, its head (`classifier`;
    DistilBERT's pre_classifier is its dense layer, with a ReLU)."""

    def __init__(self, config, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        check_config(config)
        self.config = config
        d, shape = config.hidden_size, BertShape.of(config)
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, d, tp)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, d)
        self.token_type_embeddings = None
        if shape.type_vocab_size:
            self.token_type_embeddings = nn.Embedding(shape.type_vocab_size, d)
        self.emb_norm = LayerNorm(d, shape.eps)
        self.layers = nn.ModuleList(BertLayer(config, tp) for _ in range(config.num_hidden_layers))
        self.offset = position_offset(config)
        self.vocab_size = config.vocab_size
        architectures = getattr(config, "architectures", None) or []
        self.classifier = None
        if any(a.endswith("ForSequenceClassification") for a in architectures):
            act = torch.relu if config.model_type == "distilbert" else torch.tanh
            self.classifier = ClassifierHead(d, config.num_labels, act=act)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        types = input_ids >> TOKEN_TYPE_SHIFT
        words = input_ids & ((1 << TOKEN_TYPE_SHIFT) - 1)
        extra = self.position_embeddings(positions + self.offset)
        if self.token_type_embeddings is not None:
            extra += self.token_type_embeddings(types)
        x = self.emb_norm(self.word_embeddings(words), extra)[0]
        for layer in self.layers:
            x = layer(x, meta)
        return x

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, weight in weights:
            ours, section = self._our_name(name)
            if ours is None:
                continue
            if ours not in params:
                raise ValueError(f"unexpected weight {name!r}")
            module, _, leaf = ours.rpartition(".")
            load_weight(self.get_submodule(module), leaf, weight, name, section)
            loaded.add(ours if section is None else f"{ours}#{section}")
        for ours in {k.split("#")[0] for k in loaded if "#" in k}:
            if all(f"{ours}#{i}" in loaded for i in range(3)):
                loaded.add(ours)
        return loaded

    def _our_name(self, name: str) -> tuple[str | None, int | None]:
        """Our parameter for a checkpoint tensor (None: one not read), and its section."""
        if name.startswith(IGNORED_PREFIXES) or name.endswith(IGNORED_SUFFIXES):
            return None, None
        if name.startswith("classifier."):  # BERT's is one Linear; RoBERTa's dense + out_proj
            rest = name.removeprefix("classifier.").removeprefix("out_proj.")
            return "classifier." + (rest if rest.startswith("dense.") else "out." + rest), None
        for prefix in ("bert.", "roberta.", "distilbert."):
            name = name.removeprefix(prefix)
        # BERT's pooler, DistilBERT's pre_classifier: the classifier's dense layer
        for prefix in ("pooler.dense.", "pre_classifier."):
            if name.startswith(prefix):
                if self.classifier is None:
                    return None, None  # a bare BertModel's pooler: embeddings skip it
                return "classifier.dense." + name.removeprefix(prefix), None
        name = name.replace("embeddings.LayerNorm", "emb_norm")
        if name.startswith("embeddings."):
            return name.removeprefix("embeddings."), None
        name = name.replace("transformer.layer.", "encoder.layer.")  # DistilBERT's
        if name.startswith("encoder.layer."):
            index, _, rest = name.removeprefix("encoder.layer.").partition(".")
            module, _, leaf = rest.rpartition(".")
            if module in LAYER_NAMES:
                ours, section = LAYER_NAMES[module]
                return f"layers.{index}.{ours}.{leaf}", section
        return name, None
