"""Rotary position embeddings: the rope settings a config names (theta, scaling: linear,
Llama 3's, YaRN, LongRoPE, Gemma 4's proportional), the cos/sin cache, the q/k row orders
for partial and interleaved rotation, and the per-head q/k norms the rotary kernel
applies with it."""

from __future__ import annotations

import math

import torch
from torch import nn

from kernels.norms import add_norm_for
from kernels.rotary import QKNorm, Rope


def rope_settings(config, layer_type: str | None = None) -> tuple[float, dict | None]:
    """(theta, scaling) from either transformers' old or new (5.x) config layout; Gemma 3
    keeps one set per layer type."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if layer_type is not None and params and layer_type in params:
        params = params[layer_type]
    theta = (params or {}).get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    return float(theta), params


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn", "proportional")


def rope_type(scaling: dict | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies, with Llama 3's frequency-dependent scaling when asked."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope_type(scaling)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "proportional":  # Gemma 4's global layers: the first pairs' frequencies only
        angles = int(scaling.get("partial_rotary_factor", 1.0) * head_dim // 2)
        inv_freq[angles:] = 0.0  # cos 1, sin 0: those pairs pass unrotated
        return inv_freq / scaling.get("factor", 1.0)
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
    within = positions[:, None] < original
    if "short_mscale" in scaling:
        # Phi-3.5-MoE's: transformers keeps the short factors at every length and scales
        # by short_mscale, or long_mscale once the batch passes the original length (here
        # per position).
        scale = torch.where(within, scaling["short_mscale"], scaling["long_mscale"])
        return torch.cat([short.cos(), short.sin()], dim=-1) * scale
    freqs = torch.where(within, short, long)
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
        # Proportional rope's share is of the frequencies (rope_inv_freq), over the whole head.
        self.rotary_dim = head_dim if kind == "proportional" else int(head_dim * factor)
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

    def build_cache(self, device: torch.device, rows: int | None = None) -> None:
        """The cos/sin table, `rows` positions of it where given (the engine's longest
        context: Llama 4's 10M-position table would take 5 GB)."""
        dim = self.rotary_dim
        if rope_type(self.scaling) == "longrope":
            cos_sin = longrope_cos_sin(dim, self.max_positions, self.theta, self.scaling)
            cos_sin = cos_sin[:rows].to(device)
        else:
            attention_factor = 1.0
            if rope_type(self.scaling) == "yarn":
                inv_freq, attention_factor = yarn_inv_freq(
                    dim, self.theta, self.scaling, self.max_positions
                )
            else:
                inv_freq = rope_inv_freq(dim, self.theta, self.scaling)
            count = rope_positions(self.max_positions, self.scaling)
            count = count if rows is None else min(count, rows)
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


def rotary_of(
    config, layer_type: str | None = None, head_dim: int | None = None
) -> RotaryEmbedding:
    """The rotary embedding a config describes: heads of `head_dim` (by default the
    config's head_dim, else hidden_size / num_attention_heads) over its
    max_position_embeddings, with the rope settings of `layer_type` where the config
    keeps them per kind."""
    head_dim = head_dim or getattr(config, "head_dim", None)
    head_dim = head_dim or config.hidden_size // config.num_attention_heads
    theta, scaling = rope_settings(config, layer_type)
    return RotaryEmbedding(head_dim, config.max_position_embeddings, theta, scaling)


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
