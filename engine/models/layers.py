"""Layers the model files are built from: paged attention, norms, vocab (rotary:
engine/models/rope.py).

Attention metadata is passed down as an argument (no global context), so one
forward can be captured in a CUDA graph with static tensors.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.distributed import SINGLE, TensorParallel
from engine.models.parallel import VocabParallelEmbedding, WeightSlice, read, vocab_rows
from kernels.fp8 import Fp8Rows
from kernels.kv_store import kv_store_for
from kernels.linear import dense
from kernels.norms import add_norm_for
from kernels.paged_attention import paged_attention_decode_for
from kernels.prefill_attention import paged_prefill_attention_for
from kernels.rotary import Rope, rotary_for


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64; < 0 = padding, not stored
    block_table: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length incl. the new tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    is_decode: bool  # every sequence has exactly one new token
    # Every token attends as a decode row of its own: block_table and seq_lens are per
    # token (its sequence's row; its position + 1). A speculative verify step's tokens
    # are a sequence's last sampled one and its drafts (engine/speculative.py).
    per_token: bool = False
    # [num_tokens] int32: the last position each token attends to, where some see past
    # themselves (Gemma 3's image tokens, their whole image: engine/images.py).
    horizons: torch.Tensor | None = None
    # [num_tokens, head_dim] fp32: each token's rotary cos/sin, where some tokens' are
    # not their position's (the Qwen VL models' image tokens: ImageRows.rope_table).
    rope_table: torch.Tensor | None = None
    # Every sequence's context is its new tokens (whole prompts, no cached prefix), for
    # attention that runs such steps apart (PagedAttention.PROMPTS_APART): set on eager
    # steps only, those beyond the prefill graphs' tokens among them.
    prompts_only: bool = False
    # [num_seqs] int64: each sequence's row of the recurrent layers' states (its
    # block-table row; a graph's padded rows the spare one).
    state_slots: torch.Tensor | None = None
    # A step with prompts of a model with recurrent layers: its sequences as they walk
    # their tokens (SequenceWalk.of, device tensors: graph steps too), or, for prompts
    # past the walk's length or off CUDA, their shape on the host, to run them padded
    # together (SequenceSpans.of; eager steps only).
    walk: SequenceWalk | None = None
    spans: SequenceSpans | None = None


@dataclass(frozen=True)
class SequenceWalk:
    """A step's sequences as the recurrent layers' walk kernels take them, their tokens end
    to end: made by device ops alone, so a CUDA graph's replay remakes it. A graph's padded
    sequences have no tokens; its padded tokens, past every sequence, the last one's."""

    token_seqs: torch.Tensor  # [tokens] int64: each token's sequence
    starts: torch.Tensor  # [seqs]: each sequence's first token
    lengths: torch.Tensor  # [seqs]: its new tokens
    slots: torch.Tensor  # [seqs] int64: its state row
    has_state: torch.Tensor  # [seqs] bool: it has context before (else it starts from zeros)

    @classmethod
    def of(cls, meta: AttentionMetadata, num_tokens: int) -> SequenceWalk:
        bounds = meta.query_start_loc
        starts, lengths = bounds[:-1], bounds[1:] - bounds[:-1]
        tokens = torch.arange(num_tokens, dtype=bounds.dtype, device=bounds.device)
        token_seqs = torch.searchsorted(bounds, tokens, right=True) - 1
        token_seqs = token_seqs.clamp_(max=len(starts) - 1)
        return cls(token_seqs, starts, lengths, meta.state_slots, meta.seq_lens > lengths)


@dataclass(frozen=True)
class SequenceSpans:
    """A step's sequences as recurrent layers run them (eager steps with prompts), from
    one read of the metadata to the host: those that continue by one token (decode rows),
    and the others' token rows padded to the longest."""

    single_rows: torch.Tensor  # [singles] int64: a continuing sequence's token row
    single_slots: torch.Tensor  # [singles] int64
    single_has_state: torch.Tensor  # [singles] bool, all True: the decode step's argument
    rows: torch.Tensor  # [seqs, longest] int64: each other sequence's token rows, then 0s
    valid: torch.Tensor  # [seqs, longest] bool: rows[i, j] is a token of sequence i
    # [valid tokens] int64: the valid entries of `rows`, and where they sit in it
    # flattened (so that padded outputs go back to their rows without a mask, whose
    # indexing would read its count to the host: a wait on the device every layer).
    valid_rows: torch.Tensor
    valid_at: torch.Tensor
    lengths: torch.Tensor  # [seqs] int64: its new tokens
    slots: torch.Tensor  # [seqs] int64
    has_state: torch.Tensor  # [seqs] bool: it has context before (else it starts from zeros)

    @classmethod
    def of(cls, meta: AttentionMetadata) -> SequenceSpans:
        starts = meta.query_start_loc.tolist()
        lengths = [b - a for a, b in zip(starts, starts[1:])]
        contexts = [n - q for n, q in zip(meta.seq_lens.tolist(), lengths)]
        slots = meta.state_slots.tolist()
        single = [i for i, n in enumerate(lengths) if n == 1 and contexts[i]]
        others = [i for i, n in enumerate(lengths) if n and not (n == 1 and contexts[i])]

        def column(values: list, seqs: list[int]) -> torch.Tensor:
            return torch.tensor([values[i] for i in seqs], dtype=torch.int64)

        length = column(lengths, others)
        steps = torch.arange(int(length.max()) if others else 0)
        valid = steps < length[:, None]
        rows = (column(starts, others)[:, None] + steps) * valid  # padding: row 0
        has_state = column(contexts, others) > 0
        valid_at = valid.flatten().nonzero().flatten()
        tensors = (column(starts, single), column(slots, single), column(contexts, single) > 0)
        tensors += (rows, valid, rows.flatten()[valid_at], valid_at, length)
        tensors += (column(slots, others), has_state)
        return cls(*(t.to(meta.query_start_loc.device) for t in tensors))


class RecurrentLayer(nn.Module):
    """A layer that carries a state per sequence instead of a KV cache (Gated DeltaNet).
    The runner allocates each of `state_shapes` by request slot, with a spare row for a
    graph's padded rows, and sets them as attributes; a sequence whose context is empty
    starts from zeros. Its states cannot be rebuilt from cached KV blocks: the prefix
    cache, when on, saves them at block boundaries (engine/state_snapshots.py)."""

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        """name -> (one slot's shape, dtype; None: the model's)."""
        raise NotImplementedError


def state_bytes(layers: list[RecurrentLayer], slots: int, dtype: torch.dtype) -> int:
    """What `allocate_states` allocates."""
    return sum(
        slots * math.prod(shape) * (state_dtype or dtype).itemsize
        for layer in layers
        for shape, state_dtype in layer.state_shapes().values()
    )


def allocate_states(
    layers: list[RecurrentLayer], slots: int, dtype: torch.dtype, device: torch.device
) -> None:
    """Each layer's states, zeroed, `slots` rows each, set as its attributes."""
    for layer in layers:
        for name, (shape, state_dtype) in layer.state_shapes().items():
            state = torch.zeros((slots, *shape), dtype=state_dtype or dtype, device=device)
            setattr(layer, name, state)


@dataclass
class AttentionOps:
    """The three cache kernels, chosen once per device (Triton on CUDA, torch elsewhere)."""

    store: Callable
    decode: Callable
    prefill: Callable

    @classmethod
    def for_device(cls, device: torch.device) -> AttentionOps:
        return cls(
            kv_store_for(device),
            paged_attention_decode_for(device),
            paged_prefill_attention_for(device),
        )


class PagedAttention(nn.Module):
    """Rotates q and k (given a Rope), stores the new K/V into this layer's cache, then
    attends over the cache."""

    KV_TENSORS = 2  # a K and a V cache (1: one cache, read as both: DeepSeek's latent)
    PROMPTS_APART = False  # told by the metadata when an eager step is whole prompts only

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int = 0,  # > 0: attend to the last `sliding_window` positions only
        softcap: float = 0.0,  # > 0: scores -> softcap * tanh(scores / softcap) (Gemma 2)
        causal: bool = True,  # False: an encoder's, each prompt whole in its step
    ) -> None:
        super().__init__()
        self.causal = causal
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.chunk = 0  # > 0: a query sees the keys of its chunk of `chunk` only (Llama 4)
        self.softcap = softcap
        # Set by the model runner once the cache is allocated.
        self.k_cache = self.v_cache = torch.empty(0)
        self.ops: AttentionOps | None = None
        # An FP8 cache holds K / k_scale and V / v_scale (from the checkpoint, else 1.0).
        self.k_scale = self.v_scale = 1.0

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        v: torch.Tensor,
        meta: AttentionMetadata,
        rope: Rope | None = None,
        sinks: torch.Tensor | None = None,  # [num_heads]: each head's sink logit (GPT-OSS)
    ) -> torch.Tensor:
        if rope is not None and meta.rope_table is not None:  # row i's cos/sin: table row i
            rows = torch.arange(len(meta.rope_table), device=q.device)
            rope = Rope(rows, meta.rope_table, rope.norm)
        if rope is not None and not meta.is_decode:  # the decode kernel rotates them itself
            q, k = rotary_for(q.device)(rope.positions, q, k, rope.cos_sin, rope.norm)
            rope = None
        q = q.view(-1, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if not meta.is_decode:  # stored before anything reads them
            self.ops.store(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        if meta.is_decode or meta.per_token:
            # A decode step's kernel rotates q and k and stores the new K/V itself: two
            # launches per layer fewer. Per token, every row's context is stored already.
            new = dict(new_k=k, new_v=v, slot_mapping=meta.slot_mapping) if meta.is_decode else {}
            out = self.ops.decode(
                q,
                self.k_cache,
                self.v_cache,
                meta.block_table,
                meta.seq_lens,
                self.scale,
                sliding_window=self.sliding_window,
                rope=rope,
                softcap=self.softcap,
                sinks=sinks,
                **new,
                **({"chunk": self.chunk} if self.chunk else {}),
            )
        else:
            out = self.ops.prefill(
                q,
                self.k_cache,
                self.v_cache,
                meta.block_table,
                meta.query_start_loc,
                meta.seq_lens,
                self.scale,
                meta.max_query_len,
                sliding_window=self.sliding_window,
                softcap=self.softcap,
                sinks=sinks,
                causal=self.causal,
                **({} if meta.horizons is None else {"horizons": meta.horizons}),
                **({"chunk": self.chunk} if self.chunk else {}),
            )
        return out.view(-1, self.num_heads * self.head_dim)


class AddNorm(nn.Module):
    """Adds a sublayer's output to the residual stream and normalizes the sum, in one
    kernel on CUDA: forward(x, residual) -> (norm(x + residual), x + residual).
    With residual None, x is the residual stream itself. rms: HF Llama's RMSNorm
    (normalize in fp32, cast back, then scale); else LayerNorm, with a bias.
    fp8_out (set by `quantize_model` where an FP8 projection takes the norm): the norm
    comes out quantized per token, as `Fp8Rows`. bias False: a LayerNorm without one
    (Cohere's)."""

    def __init__(self, dim: int, eps: float, rms: bool, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = None if rms or not bias else nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.rms = rms
        self.fp8_out = False

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
        add_norm = add_norm_for(x.device)
        return add_norm(x, residual, self.weight, self.bias, self.eps, self.rms, self.fp8_out)


LayerNorm = functools.partial(AddNorm, rms=False)
RMSNorm = functools.partial(AddNorm, rms=True)


def layer_sliding_windows(config) -> list[int]:
    """Each layer's attention window (0: full attention), as transformers masks them:
    per `layer_types` where the config lists them (Qwen2/3's use_sliding_window, Gemma 3's
    interleaving), else `sliding_window` on every layer (Mistral, Mixtral, Phi-3)."""
    window = getattr(config, "sliding_window", None) or 0
    types = getattr(config, "layer_types", None)
    if types is not None:
        return [window if t == "sliding_attention" else 0 for t in types]
    return [window] * config.num_hidden_layers


class LMHead(nn.Module):
    """Projects hidden states to logits over the real vocabulary (padding rows sliced off).

    The rows are padded to a multiple of 64 so the GEMM runs on aligned tiles (GPT-2's
    50257 is slow). Vocab-parallel: each rank holds its share of the padded rows (64 * size
    of them), and the shares' logits are gathered (TensorParallel.gather_logits)."""

    def __init__(
        self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE, bias: bool = False
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp
        self.vocab_start, rows = vocab_rows(vocab_size, 64, tp)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.bias = nn.Parameter(torch.zeros(rows)) if bias else None  # Phi's

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = dense(hidden, self.weight, self.bias)  # [rows, this rank's vocab]
        return self.tp.gather_logits(logits)[:, : self.vocab_size]

    def load_shard(self, leaf: str, weight: WeightSlice, section: None) -> None:
        """This rank's rows of the [vocab, hidden] matrix, as the embedding's, or of the
        bias; padding rows stay zero."""
        if leaf == "weight":
            VocabParallelEmbedding.load_shard(self, leaf, weight, section)
            return
        start = self.vocab_start
        stop = min(start + self.bias.shape[0], self.vocab_size)
        self.bias.data.zero_()
        bias = read(weight, [self.vocab_size])
        self.bias.data[: max(0, stop - start)].copy_(bias[start:stop])
