"""Falcon (`falcon`: Falcon-7B/40B/180B, Falcon2-11B): gpt_neox.py's layers. Attention
and MLP in parallel on one LayerNorm (7B, Falcon2) or on one each (40B/180B's
`new_decoder_architecture`), or one after the other; query_key_value's rows by kv group
(each group's q heads, then its k and v), multi-query (all q heads, then one k and v) or
head by head; the whole head rotated; a tied head. Falcon-RW's ALiBi is refused."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.distributed import SINGLE, TensorParallel
from engine.models.gpt2 import heads_in_sections
from engine.models.gpt_neox import GPTNeoXForCausalLM, NeoXLayer, from_transformer
from engine.models.llama import AttentionOptions
from engine.models.parallel import WeightSlice

# Falcon's (under transformer., its h. as layers.) -> ours.
RENAMES = {
    "word_embeddings.": "embed_tokens.",
    "self_attention.query_key_value": "self_attn.qkv_proj",
    "self_attention.dense": "self_attn.o_proj",
    "mlp.dense_h_to_4h": "mlp.up",
    "mlp.dense_4h_to_h": "mlp.down",
    "ln_attn": "input_layernorm",
    "ln_mlp": "post_attention_layernorm",
    "ln_f.": "norm.",
}


class FalconForCausalLM(GPTNeoXForCausalLM):
    RENAMES = RENAMES

    def __init__(self, config, tp: TensorParallel = SINGLE) -> None:
        if config.alibi:
            raise ValueError("unsupported alibi=True (Falcon-RW's position encoding)")
        if config.new_decoder_architecture and not config.parallel_attn:
            raise ValueError("unsupported new_decoder_architecture without parallel_attn")
        super().__init__(config, tp)

    def num_kv_heads(self) -> int:
        config = self.config
        if config.new_decoder_architecture or not config.multi_query:
            return config.num_kv_heads
        return 1

    def attention(self, config) -> AttentionOptions:
        return AttentionOptions(self.num_kv_heads(), qkv_bias=config.bias, o_bias=config.bias)

    def make_layer(self, config, tp: TensorParallel) -> NeoXLayer:
        # Two norms, each sublayer's, only in the new layout (num_ln_in_parallel_attn 2).
        two_norms = config.new_decoder_architecture and config.num_ln_in_parallel_attn != 1
        shared = config.parallel_attn and not two_norms
        parallel = config.parallel_attn
        return NeoXLayer(config, self.rotary, tp, parallel, self.attention(config), shared)

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        return super().load_weights((from_transformer(n), w) for n, w in weights)

    def _qkv_in_sections(self, weight: WeightSlice) -> torch.Tensor:
        """query_key_value's rows as q, k, v sections."""
        config = self.config
        heads, kv_heads = config.num_attention_heads, self.num_kv_heads()
        if not config.new_decoder_architecture and not config.multi_query:
            return heads_in_sections(weight, heads)
        shape = weight.get_shape()
        tensor = weight[tuple(slice(None) for _ in shape)]
        if not config.new_decoder_architecture:  # multi-query: in sections already
            return tensor
        groups = tensor.reshape(kv_heads, heads // kv_heads + 2, -1, *shape[1:])
        q, k, v = groups[:, :-2], groups[:, -2], groups[:, -1]
        return torch.cat([x.reshape(-1, *shape[1:]) for x in (q, k, v)])
