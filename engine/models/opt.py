"""OPT (`opt`: OPT-125M to 66B): gpt_neox.py's sequential layers without rotation,
learned positions (offset by 2) added to the embeddings, a ReLU MLP (fc1/fc2), biases
where `enable_bias`, a tied head. opt-350m's post-norm layers are refused."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.distributed import SINGLE, TensorParallel
from engine.models.gpt_neox import GPTNeoXForCausalLM, NeoXLayer
from engine.models.layers import AttentionMetadata
from engine.models.llama import AttentionOptions
from engine.models.parallel import WeightSlice

# OPT's (under model.decoder.) -> ours; its layers' final_layer_norm is read first.
RENAMES = {
    "self_attn_layer_norm": "input_layernorm",
    ".final_layer_norm": ".post_attention_layernorm",
    "final_layer_norm": "norm",
    "out_proj": "o_proj",
    "fc1": "mlp.up",
    "fc2": "mlp.down",
}


class OPTForCausalLM(GPTNeoXForCausalLM):
    RENAMES = RENAMES
    POSITION_OFFSET = 2  # OPT's table keeps two rows before position 0

    def __init__(self, config, tp: TensorParallel = SINGLE) -> None:
        if not config.do_layer_norm_before or config.word_embed_proj_dim != config.hidden_size:
            raise ValueError("unsupported post-norm OPT (opt-350m's do_layer_norm_before=False)")
        if config._remove_final_layer_norm or not config.layer_norm_elementwise_affine:
            raise ValueError("unsupported OPT without its final or affine LayerNorms")
        super().__init__(config, tp)
        rows = config.max_position_embeddings + self.POSITION_OFFSET
        self.embed_positions = nn.Embedding(rows, config.hidden_size)  # replicated

    def attention(self, config) -> AttentionOptions:
        bias = config.enable_bias
        return AttentionOptions(config.num_attention_heads, qkv_bias=bias, o_bias=bias)

    def make_layers(self, config) -> list[nn.Module]:
        self.rotary = None
        options = self.attention(config)
        return [
            NeoXLayer(config, None, self.tp, False, options)
            for _ in range(config.num_hidden_layers)
        ]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        # The first norm adds the two embeddings, as GPT-2's.
        x = self.embed_tokens(input_ids)
        residual = self.embed_positions(positions + self.POSITION_OFFSET)
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        return self.norm(x, residual)[0]

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        return super().load_weights((n.removeprefix("model.decoder."), w) for n, w in weights)
