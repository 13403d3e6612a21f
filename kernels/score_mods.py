"""What the attention kernels do to the scores beyond softmax(q . k * scale): Gemma 2's
soft-cap (scores -> cap * tanh(scores / cap)) and GPT-OSS's sinks (a learned logit per
head in every softmax's denominator, with no value). Each as its torch reference and
the jit function both kernels call."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def soft_cap_ref(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """Gemma 2's attention soft-cap, as transformers applies it (softcap 0: none)."""
    return torch.tanh(scores / softcap) * softcap if softcap > 0 else scores


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of [num_heads, ..., keys] scores, each head's sink logit
    (if any) taking its share of the denominator, as transformers' GPT-OSS does."""
    if sinks is None:
        return scores.softmax(dim=-1)
    sink = sinks.float().view(-1, *[1] * (scores.dim() - 1)).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]


@triton.jit
def sink_start(sinks_ptr, heads, mask, counted, SINKS: tl.constexpr, ROWS: tl.constexpr):
    # The running max (log2 units) and denominator a softmax starts from: where `counted`,
    # the heads' sink logits as one key of value 0 (the rows of a head hold it once).
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    if SINKS:
        sink = tl.load(sinks_ptr + heads, mask=mask, other=0.0).to(tl.float32)
        m_i = tl.where(counted, sink * 1.4426950408889634, m_i)  # LOG2E
        l_i = tl.where(counted, 1.0, l_i)
    return m_i, l_i


@triton.jit
def soft_cap(scores, cap):
    # cap * tanh(scores / cap) for scores and cap in the same units (the kernels' log2
    # units: both times LOG2E), tanh(x) = 1 - 2 / (exp(2x) + 1) with exp(2x) = exp2(2x *
    # LOG2E), so the interpreter runs it too; +-cap where exp2 overflows or vanishes.
    e = tl.exp2(scores * (2.8853900817779268 / cap))  # 2 * LOG2E
    return cap - 2.0 * cap / (e + 1.0)
