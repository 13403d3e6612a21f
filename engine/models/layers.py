"""Layers the model files are built from: paged attention, norms, rotary, vocab.

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
from kernels.rotary import QKNorm, Rope, rotary_for


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


def rope_settings(config, layer_type: str | None = None) -> tuple[float, dict | None]:
    """(theta, scaling) from either transformers' old or new (5.x) config layout; Gemma 3
    keeps one set per layer type."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if layer_type is not None and params and layer_type in params:
        params = params[layer_type]
    theta = (params or {}).get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    return float(theta), params


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


def rope_type(scaling: dict | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies, with Llama 3's frequency-dependent scaling when asked."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope_type(scaling)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_positions(max_position_embeddings: int, scaling: dict | None) -> int:
    """The positions a model's rotation serves: max_position_embeddings, or YaRN's original
    length times its factor where that is longer (vLLM's rule: YaRN is how Qwen3 goes from
    32k to 128k while its config keeps the shorter max_position_embeddings)."""
    if rope_type(scaling) == "yarn" and scaling.get("factor"):
        original = scaling.get("original_max_position_embeddings") or max_position_embeddings
        return max(max_position_embeddings, int(original * scaling["factor"]))
    return max_position_embeddings


def yarn_inv_freq(
    head_dim: int, theta: float, scaling: dict, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """YaRN (Qwen2.5/Qwen3 long context): each frequency between its interpolated (/ factor)
    and original value by how many turns it makes within original_max_position_embeddings,
    and the attention factor that scales cos and sin; as transformers computes them."""
    original = scaling.get("original_max_position_embeddings") or max_position_embeddings
    factor = scaling.get("factor") or max_position_embeddings / original

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        weights = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, weights[0]) / mscale(factor, weights[1]) if all(weights)
            else mscale(factor)
        )  # fmt: skip

    def correction_dim(turns: float) -> float:  # the dim whose frequency turns `turns` times
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = (
        correction_dim(scaling.get("beta_fast") or 32),
        correction_dim(scaling.get("beta_slow") or 1),
    )
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    span = high - low if high != low else 0.001
    ramp = (torch.arange(head_dim // 2, dtype=torch.float32) - low) / span
    extrapolate = 1 - ramp.clamp(0, 1)  # 1: keep the original frequency, 0: interpolate
    powers = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    inv_freq = 1.0 / (factor * powers) * (1 - extrapolate) + 1.0 / powers * extrapolate
    return inv_freq, float(attention_factor)


def longrope_cos_sin(
    head_dim: int, max_positions: int, theta: float, scaling: dict
) -> torch.Tensor:  # [max_positions, head_dim]
    """Phi-3's LongRoPE: short factors below original_max_position_embeddings, long ones
    from there on, and cos/sin scaled by the attention factor.

    Per position, so a cached key never changes. transformers instead re-runs a
    sequence's whole context with the long factors once it passes the original length
    (Phi3ForCausalLM.prepare_inputs_for_generation): the two agree token for token
    while prompt + generation fit original_max_position_embeddings, and differ after."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_positions / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    positions = torch.arange(max_positions, dtype=torch.float32)
    short, long = (
        torch.outer(positions, 1.0 / (torch.tensor(scaling[k]) * theta**exponents))
        for k in ("short_factor", "long_factor")
    )
    freqs = torch.where(positions[:, None] < original, short, long)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor


def rotary_dim_order(head_dim: int, rotary_dim: int) -> list[int]:
    """With partial rotary (Phi-4-mini), the head's dims in the order the kernels rotate
    them: entry j is the checkpoint's dim now at j. transformers pairs dim i with i +
    rotary_dim / 2 among the first rotary_dim; the kernels pair j with j + head_dim / 2
    over the whole head. Each rotated pair moves to the first slots of the halves, the
    unrotated dims fill the rest (their rows of the cos/sin table are 1 and 0). q and k
    go through the same reordering, so their dot products do not change."""
    half, rotary_half = head_dim // 2, rotary_dim // 2
    passing = list(range(rotary_dim, head_dim))
    first = list(range(rotary_half)) + passing[: half - rotary_half]
    return first + list(range(rotary_half, rotary_dim)) + passing[half - rotary_half :]


def interleaved_dim_order(head_dim: int, rotary_dim: int) -> list[int]:
    """With the rotation on interleaved pairs (GPT-J's: dims 2i and 2i + 1 at frequency
    i, over the first rotary_dim dims), the head's dims in the order the kernels rotate
    them, as rotary_dim_order's: each pair's dims to the first slots of the halves."""
    half, rotary_half = head_dim // 2, rotary_dim // 2
    passing = list(range(rotary_dim, head_dim))
    first = list(range(0, rotary_dim, 2)) + passing[: half - rotary_half]
    return first + list(range(1, rotary_dim, 2)) + passing[half - rotary_half :]


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) rotary embedding with a cos/sin cache; with a
    partial_rotary_factor, over its share of each head (`dim_order`)."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict | None
    ) -> None:
        super().__init__()
        kind = rope_type(scaling)
        if kind not in SUPPORTED_ROPE_TYPES:
            supported = ", ".join(SUPPORTED_ROPE_TYPES)
            raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: {supported})")
        factor = (scaling or {}).get("partial_rotary_factor", 1.0)
        self.rotary_dim = int(head_dim * factor)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise ValueError(f"unsupported partial_rotary_factor {factor} for head_dim {head_dim}")
        # The q/k dims' order for the kernels (the model reorders its q/k rows), or None.
        self.dim_order = (
            None if self.rotary_dim == head_dim else rotary_dim_order(head_dim, self.rotary_dim)
        )
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        # The Qwen VL models': how many frequencies follow each of the 3-D position's parts
        # (engine/images.py, ImageRows.rope_table).
        self.mrope_section = (scaling or {}).get("mrope_section")
        self.mrope_interleaved = (scaling or {}).get("mrope_interleaved", False)  # Qwen3-VL's
        self.cos_sin = torch.empty(0)

    def build_cache(self, device: torch.device) -> None:
        dim = self.rotary_dim
        if rope_type(self.scaling) == "longrope":
            cos_sin = longrope_cos_sin(dim, self.max_positions, self.theta, self.scaling)
            cos_sin = cos_sin.to(device)
        else:
            attention_factor = 1.0
            if rope_type(self.scaling) == "yarn":
                inv_freq, attention_factor = yarn_inv_freq(
                    dim, self.theta, self.scaling, self.max_positions
                )
            else:
                inv_freq = rope_inv_freq(dim, self.theta, self.scaling)
            count = rope_positions(self.max_positions, self.scaling)
            positions = torch.arange(count, device=device, dtype=torch.float32)
            freqs = torch.outer(positions, inv_freq.to(device))  # [positions, dim / 2]
            cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # fp32
            if attention_factor != 1.0:
                cos_sin *= attention_factor
        if dim < self.head_dim:  # the unrotated dims: cos 1, sin 0
            cos, sin = cos_sin.chunk(2, dim=-1)
            rest = (self.head_dim - dim) // 2
            cos = torch.cat([cos, cos.new_ones(len(cos), rest)], dim=-1)
            cos_sin = torch.cat([cos, sin, sin.new_zeros(len(sin), rest)], dim=-1)
        self.cos_sin = cos_sin

    def rope(
        self,
        positions: torch.Tensor,  # [num_tokens]
        q_norm: HeadNorm | None = None,
        k_norm: HeadNorm | None = None,
    ) -> Rope:
        """The rotation of a step's q and k, each head RMS-normed first where q_norm/k_norm
        are given, for PagedAttention to apply (one kernel, or inside the decode kernel)."""
        norm = None if q_norm is None else QKNorm(q_norm.weight, k_norm.weight, q_norm.eps)
        return Rope(positions, self.cos_sin, norm)


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


class HeadNorm(nn.Module):
    """RMSNorm weights over each head's vector (Qwen3's and Gemma 3's q/k norms), applied
    by RotaryEmbedding.forward together with the rotation, or where a layer has none
    (EXAONE 4's global layers) by this module."""

    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, heads * head_dim]
        heads = x.reshape(-1, self.weight.shape[0])
        add_norm = add_norm_for(x.device)
        return add_norm(heads, None, self.weight, None, self.eps, True, False)[0].view(x.shape)
