"""Gemma 3 text (Gemma3ForCausalLM) and Gemma 2: scaled embeddings, (1 + weight) RMSNorms,
norms before and after each sublayer, GeGLU, query_pre_attn_scalar, interleaved
sliding-window (local) and full (global) layers, and the final logit soft-cap where the
config sets one. Gemma 3 adds per-head q/k norms and a rope base per layer kind; Gemma 2
soft-caps the attention scores (attn_logit_softcapping, in the attention kernels).
Gemma (1) is Llama's layers (norms before each sublayer only) with the scaled
embeddings, (1 + weight) norms and GeGLU. Attention and loading are llama.py's."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
from torch import nn

from engine.distributed import SINGLE, TensorParallel
from engine.models.layers import AttentionMetadata, RMSNorm, layer_sliding_windows
from engine.models.llama import AttentionOptions, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from engine.models.parallel import TensorSlice, WeightSlice, read
from engine.models.rope import RotaryEmbedding, rotary_of

# HF names are Llama's (q/k/v and gate/up fused the same way) plus these norms, whose
# weights HF applies as (1 + weight): folded in at load.
NORMS = ("norm", "q_norm", "k_norm", "input_layernorm", "post_attention_layernorm")
NORMS += ("pre_feedforward_layernorm", "post_feedforward_layernorm")


def check_config(config) -> None:
    if getattr(config, "use_bidirectional_attention", False) and config.model_type != "gemma3_text":
        raise ValueError("unsupported use_bidirectional_attention=True")
    if getattr(config, "hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"unsupported hidden_activation {config.hidden_activation!r}")
    if config.model_type == "gemma" and config.hidden_act != "gelu_pytorch_tanh":
        raise ValueError(f"unsupported hidden_act {config.hidden_act!r}")


class Gemma3DecoderLayer(LlamaDecoderLayer):
    # The norm after attention goes to the residual stream; the MLP reads the one before it.
    FP8_FEEDS: ClassVar[dict[str, str]] = {
        "input_layernorm": "self_attn.qkv_proj",
        "pre_feedforward_layernorm": "mlp.gate_up_proj",
    }

    def __init__(
        self,
        config,
        rotary: RotaryEmbedding,
        sliding_window: int,
        tp: TensorParallel = SINGLE,
        act: str = "gelu_tanh",  # GLM-4's layers, the same shape, have SiLU
        attention: AttentionOptions = AttentionOptions(),
        mlp: nn.Module | None = None,  # Arcee Trinity's (experts); None: LlamaMLP with act
        self_attn: nn.Module | None = None,  # Arcee Trinity's gated attention
    ) -> None:
        mlp = mlp or LlamaMLP(config, tp, act=act)
        super().__init__(config, rotary, sliding_window, mlp, tp, attention, self_attn)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the last sublayer's normed output, not yet added to the residual stream."""
        h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(positions, h, meta))[0]
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.feed_forward(h, residual))[0], residual

    def feed_forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The MLP's output for its normed input h (Gemma 4 adds experts that read the
        residual stream)."""
        return self.mlp(h)


class Gemma3ForCausalLM(LlamaForCausalLM):
    check_config = staticmethod(check_config)

    def __init__(self, config, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, tp)
        self.tie_word_embeddings = getattr(config, "tie_word_embeddings", True)
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.embed_scale = config.hidden_size**0.5
        # EmbeddingGemma: attention both ways, embeddings only (an encoder to the engine).
        self.is_encoder = getattr(config, "use_bidirectional_attention", False) is True
        if self.is_encoder:
            self.has_lm_head = False

    def make_layers(self, config) -> list[nn.Module]:
        self.rotary_local, self.rotary_global = (
            rotary_of(config, kind) for kind in ("sliding_attention", "full_attention")
        )
        windows = layer_sliding_windows(config)
        both_ways = getattr(config, "use_bidirectional_attention", False)  # EmbeddingGemma
        if both_ways:  # transformers' window is |q - k| < sliding_window, the kernels' <= theirs
            windows = [max(w - 1, 1) if w else 0 for w in windows]
        attention = AttentionOptions(causal=not both_ways)
        return [
            Gemma3DecoderLayer(
                config,
                self.rotary_local if w else self.rotary_global,
                w,
                self.tp,
                attention=attention,
            )
            for w in windows
        ]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # As HF: the scale rounded to the weights' dtype first (a host value: no sync).
        return x * torch.tensor(self.embed_scale, dtype=x.dtype).item()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.is_encoder:  # its pooling rows' one token, sampled and dropped, is 0
            return hidden.new_zeros(hidden.shape[0], self.config.vocab_size)
        logits = self.lm_head(hidden)  # [num_seqs, vocab_size]
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        def folded() -> Iterator[tuple[str, WeightSlice]]:
            for name, weight in weights:
                if name.rpartition(".")[0].rpartition(".")[2] in NORMS:  # replicated: read whole
                    weight = TensorSlice(1.0 + read(weight, weight.get_shape()).float())
                yield name, weight

        return super().load_weights(folded())


class GemmaForCausalLM(Gemma3ForCausalLM):
    """Gemma (1): Llama's pre-norm layers with GeGLU; Gemma 2's embeddings, norms and head."""

    def make_layers(self, config) -> list[nn.Module]:
        self.rotary = rotary_of(config)
        return [
            LlamaDecoderLayer(config, self.rotary, 0, LlamaMLP(config, self.tp, act="gelu_tanh"))
            for _ in range(config.num_hidden_layers)
        ]
