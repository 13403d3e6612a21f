"""Gated DeltaNet (Qwen 3.5's and Qwen3-Next's linear attention) and its rule's chunked form.

Each head keeps a state S [k_dim, v_dim] instead of a KV cache. Token t decays it by
exp(g_t) <= 1, then writes the part of v_t the state does not already predict for k_t:

    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

A decode row takes that step once (kernels/gated_delta.py); a short prompt walks its
tokens through it in one launch (on CUDA). A long prompt's tokens run chunk by chunk
(`chunked_rule`): within a chunk the writes are solved for at once (the UT transform: a
unit-triangular system over the chunk), so the scan is over chunks, not tokens
(kernels/delta_chunk_scan.py).

q, k and v come from a causal depthwise convolution over the last `kernel` tokens' input
rows (kernels/conv_step.py; `causal_conv` for the chunked form); a sequence's last
kernel - 1 rows are its conv state. Both states
live by request slot (`RecurrentLayer`), in fp32 for the rule's state as transformers keeps it.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import SINGLE, TensorParallel
from engine.models.layers import AttentionMetadata, RecurrentLayer, SequenceSpans, SequenceWalk
from engine.models.parallel import (
    ColumnParallelLinear,
    Ranges,
    RowParallelLinear,
    Section,
    WeightSlice,
    read,
    split,
)
from engine.models.weight_copy import fill
from kernels.conv_step import conv_step_at_slots_for, conv_tokens_at_slots
from kernels.delta_chunk_scan import delta_chunk_scan_for
from kernels.gated_delta import (
    delta_rule_inputs,
    gated_delta_step_for,
    gated_delta_tokens,
    walkable,
)
from kernels.gated_norm import gated_rms_norm_for
from kernels.paged_attention import dot_precision

CHUNK = 64  # tokens a chunk of the UT transform solves at once
# A step's prompts up to this long walk their tokens in one launch a layer on CUDA
# (ConvRecurrentLayer.walk_tokens) instead of the chunked form's some fifty torch ops,
# which cost the host more than the device and read the prompts' shape to the host: so
# these steps also replay prefill graphs. The walk is serial in tokens: past ~512 the
# chunked form is faster (gated-delta-walk-ab-h200.json, in git history).
WALK_MAX_TOKENS = 512
# Steps of up to this many tokens with prompts replay prefill graphs (they must walk):
# below it a graph saves most of a step's launches; from it on the eager step was as
# fast, beside decodes or not (benchmarks/results/prompt-graphs-qwen3.5-27b-h200.json).
GRAPH_MAX_TOKENS = 256


def graph_limit(layers: list[RecurrentLayer], device: torch.device) -> int:
    """The largest step with prompts that replays a prefill graph (0: none)."""
    return min(walk_limit(layers, device), GRAPH_MAX_TOKENS)


def walk_limit(layers: list[RecurrentLayer], device: torch.device) -> int:
    """The longest prompt a step's recurrent layers walk rather than chunk: on CUDA where
    every layer has the kernels (`walkable`), WALK_MAX_TOKENS; else 0 (the Triton
    interpreter is no faster than the chunked form on the CPU)."""
    walk = device.type == "cuda" and all(getattr(x, "walkable", False) for x in layers)
    return WALK_MAX_TOKENS if walk else 0


def causal_conv(
    x: torch.Tensor,  # [seqs, num_tokens, channels]: each sequence's new rows, zeros after
    state: torch.Tensor,  # [seqs, channels, kernel - 1]: the rows before them
    weight: torch.Tensor,  # [channels, kernel]
    lengths: torch.Tensor,  # [seqs] int64: each sequence's new rows
    bias: torch.Tensor | None = None,  # [channels] (Mamba-2's)
    silu: bool = True,  # False: the convolution alone (LFM2's)
) -> tuple[torch.Tensor, torch.Tensor]:  # (silu(conv) [seqs, num_tokens, channels], new states)
    full = torch.cat([state, x.transpose(1, 2).to(state.dtype)], dim=2)  # [seqs, ch, k - 1 + n]
    bias = None if bias is None else bias.to(full.dtype)
    out = F.conv1d(full, weight.to(full.dtype)[:, None], bias, groups=weight.shape[0])
    # A sequence's new state: the kernel - 1 rows up to its last new one.
    last = lengths[:, None, None] + torch.arange(weight.shape[1] - 1, device=x.device)
    out = F.silu(out) if silu else out
    return out.transpose(1, 2), full.gather(2, last.expand(*state.shape))


def chunked_rule(
    q: torch.Tensor,  # [..., num_tokens, k_dim]: l2-normed and scaled, fp32
    k: torch.Tensor,  # [..., num_tokens, k_dim]: l2-normed
    v: torch.Tensor,  # [..., num_tokens, v_dim]
    g: torch.Tensor,  # [..., num_tokens]: log decay, <= 0
    beta: torch.Tensor | None,  # [..., num_tokens]; None: no delta term (Mamba-2's rule)
    state: torch.Tensor,  # [..., k_dim, v_dim]: the state before the first token
    precision: str = "ieee",  # the scan's dots (delta_chunk_scan): "tf32" for a 16-bit model
) -> tuple[torch.Tensor, torch.Tensor]:  # (o [..., num_tokens, v_dim], the final state)
    """The recurrence over tokens, CHUNK at a time, for each of the leading dims
    (sequences, heads). Within a chunk, with G_i the decay summed up to token i, the
    writes u solve (I + A) u = beta (v - ...) where A[i, j] = beta_i exp(G_i - G_j) k_i . k_j
    below the diagonal. A token with g = beta = 0 (padding) changes nothing. Without beta,
    the rule is S <- exp(g) S + k v^T (Mamba-2's SSD form): the writes are the values and
    the state before a chunk takes nothing back."""
    *lead, n, _ = k.shape
    pad = -n % CHUNK
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    chunks = (n + pad) // CHUNK
    q, k, v = (t.view(*lead, chunks, CHUNK, -1) for t in (q, k, v))
    decay = F.pad(g, (0, pad)).view(*lead, chunks, CHUNK).cumsum(-1)  # G_i
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    # exp(G_i - G_j) for j <= i, else 0 (masked before exp: the difference may overflow).
    between = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    if beta is None:
        writes, reads = v, torch.zeros_like(k)
    else:
        beta = F.pad(beta, (0, pad)).view(*lead, chunks, CHUNK, 1)
        system = (beta * k) @ k.transpose(-1, -2) * between  # its diagonal is ignored: unit
        writes = torch.linalg.solve_triangular(system, beta * v, upper=False, unitriangular=True)
        # What the state before the chunk contributes to each write, through the same solve.
        reads = torch.linalg.solve_triangular(
            system, beta * k * decay.exp()[..., None], upper=False, unitriangular=True
        )
    scores = q @ k.transpose(-1, -2) * between  # within the chunk, causal
    q_decayed = q * decay.exp()[..., None]
    # Each key's decay from its token to the chunk's end, as the state carries it on.
    k_to_end = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()  # [..., chunks]
    # Chunk after chunk, each from the state the last one left.
    terms = (writes, reads, q_decayed, scores, k_to_end, chunk_decay, state)
    flat = [t.reshape(-1, *t.shape[len(lead) :]) for t in terms]  # leading dims as one
    out, state = delta_chunk_scan_for(q.device)(*flat, precision)
    return out.view(*lead, -1, v.shape[-1])[..., :n, :], state.view(*lead, *state.shape[1:])


class DepthwiseConv(nn.Module):
    """The convolution's weights [channels, kernel] (and bias, where it has one): this
    rank's rows of q, k and v, read from the checkpoint's [channels, 1, kernel] by the
    same sections as the projection."""

    def __init__(self, sections: list[Section], kernel: int, bias: bool = False) -> None:
        super().__init__()
        self.sections = sections
        channels = sum(s.local_size for s in sections)
        self.weight = nn.Parameter(torch.empty(channels, kernel))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None

    def load_shard(self, leaf: str, weight: WeightSlice, section: None) -> None:
        size, kernel = self.sections[0].size, self.weight.shape[1]
        ranges = tuple(r for s in self.sections for r in s.ranges)
        if leaf == "bias":
            fill(self.bias.data, read(weight, [size], ranges))
        else:
            fill(self.weight.data, read(weight, [size, 1, kernel], ranges)[:, 0])


def head_rows(heads: Section, dim: int, offset: int = 0) -> Ranges:
    """The rows of a tensor laid out head by head (`dim` rows a head, from `offset`) that
    hold this rank's `heads`."""
    return tuple((offset + a * dim, offset + b * dim) for a, b in heads.ranges)


def grouped_rows(heads: Section, stride: int, offset: int, width: int) -> Ranges:
    """Rows `offset` to `offset + width` of each of this rank's `heads`' blocks of
    `stride` rows: a tensor laid out head by head, several parts a head."""
    return tuple(
        (h * stride + offset, h * stride + offset + width)
        for first, last in heads.ranges
        for h in range(first, last)
    )


class ConvRecurrentLayer(RecurrentLayer):
    """A recurrent layer whose input passes the causal convolution first (the DeltaNet's,
    Mamba-2's). A step with prompts walks every sequence's tokens, end to end, through the
    convolution's kernel and the rule's (`walk_tokens`), where the runner set
    `meta.walk`; or (long prompts, or off CUDA) runs the sequences that continue by one
    token as decode rows (`step_rows`) and the rest padded together to the longest,
    convolved here from their slots' windows, then through the chunked rule
    (`run_prompts`)."""

    conv1d: DepthwiseConv
    conv_state: torch.Tensor  # [slots, channels, kernel - 1]: by slot, see RecurrentLayer
    CONV_SILU: ClassVar[bool] = True  # a SiLU after the convolution (not LFM2's)

    @property
    def walkable(self) -> bool:
        """Whether the walk kernels take this layer's states (walk_limit)."""
        return True

    def step_rows(self, x: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        """(x, the layer's other inputs, slots, has_state) -> [rows, heads, dim] fp32."""
        raise NotImplementedError

    def run_prompts(
        self, conved: torch.Tensor, *inputs: torch.Tensor, spans: SequenceSpans
    ) -> torch.Tensor:
        """Padded prompts: conved [seqs, longest, channels] and the other inputs [seqs,
        longest, ...] -> [seqs, longest, heads, dim] fp32, each state updated at its slot."""
        raise NotImplementedError

    def walk_tokens(
        self, conved: torch.Tensor, *inputs: torch.Tensor, walk: SequenceWalk
    ) -> torch.Tensor:
        """The step's tokens end to end: conved [tokens, channels] and the other inputs
        [tokens, ...] -> [tokens, heads, dim] fp32, each sequence's tokens walked in one
        launch from its slot's state, updated there (CUDA, or Triton's interpreter)."""
        raise NotImplementedError

    def run_sequences(
        self, meta: AttentionMetadata, out_shape: tuple[int, int], x: torch.Tensor,
        *inputs: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """[tokens, *out_shape] fp32: each token's output of the rule."""
        weight, bias, silu = self.conv1d.weight, self.conv1d.bias, self.CONV_SILU
        if (walk := meta.walk) is not None:
            args = (walk.token_seqs, walk.starts, walk.lengths, walk.slots, walk.has_state)
            conved = conv_tokens_at_slots(x, self.conv_state, *args, weight, bias, silu)
            return self.walk_tokens(conved, *inputs, walk=walk)
        spans = meta.spans
        out = torch.empty((len(x), *out_shape), dtype=torch.float32, device=x.device)
        if len(spans.single_rows):
            rows = spans.single_rows
            args = (*(t[rows] for t in inputs), spans.single_slots, spans.single_has_state)
            out[rows] = self.step_rows(x[rows], *args)
        if len(spans.slots):
            rows, slots = spans.rows, spans.slots
            conv = self.conv_state[slots] * spans.has_state[:, None, None]
            conved, conv = causal_conv(x[rows], conv, weight, spans.lengths, bias, silu)
            self.conv_state.index_copy_(0, slots, conv)
            o = self.run_prompts(conved.to(x.dtype), *(t[rows] for t in inputs), spans=spans)
            out[spans.valid_rows] = o.flatten(0, 1)[spans.valid_at]
        return out


class GatedDeltaNet(ConvRecurrentLayer):
    """Qwen 3.5's linear attention layer. One projection gives q, k, v (convolved), z (the
    output gate), b (beta's logit) and a (the decay's); each rank holds its share of the
    key and value heads (a value head reads key head h // (value heads / key heads), so
    contiguous shares keep each group on one rank) and out_proj sums the ranks'."""

    def __init__(self, config, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
        if hv % hk:
            raise ValueError(f"linear_num_value_heads {hv} is not a multiple of {hk} key heads")
        k_heads = split(hk, tp, "linear_num_key_heads")
        self.v_heads = split(hv, tp, "linear_num_value_heads")
        self.num_k_heads, self.num_v_heads = hk // tp.size, hv // tp.size
        self.k_dim, self.v_dim = dk, dv
        conv_dim = 2 * hk * dk + hv * dv  # q, k, v rows, as in_proj_qkv and conv1d hold them
        qkv = [
            Section(conv_dim, head_rows(k_heads, dk)),
            Section(conv_dim, head_rows(k_heads, dk, hk * dk)),
            Section(conv_dim, head_rows(self.v_heads, dv, 2 * hk * dk)),
        ]
        self.in_proj = ColumnParallelLinear(
            config.hidden_size, self.projection(k_heads, qkv), bias=False
        )
        self.sizes = [s.local_size for s in self.in_proj.sections]
        self.conv1d = DepthwiseConv(qkv, config.linear_conv_kernel_dim)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm_weight = nn.Parameter(torch.empty(dv))  # the gated norm's, over each head
        self.eps = config.rms_norm_eps
        self.out_proj = RowParallelLinear(hv * dv, config.hidden_size, bias=False, tp=tp)
        self.conv_state = self.rule_state = torch.empty(0)  # by slot: see RecurrentLayer

    def projection(self, k_heads: Section, qkv: list[Section]) -> list[Section]:
        """in_proj's sections q, k, v, z, b, a as the checkpoint holds them: Qwen 3.5's
        in_proj_qkv (the conv's rows), in_proj_z, in_proj_b and in_proj_a."""
        z = Section(self.v_heads.size * self.v_dim, head_rows(self.v_heads, self.v_dim))
        return [*qkv, z, self.v_heads, self.v_heads]

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        channels, kernel = self.conv1d.weight.shape
        return {
            "conv_state": ((channels, kernel - 1), None),
            "rule_state": ((self.num_v_heads, self.k_dim, self.v_dim), torch.float32),
        }

    def load_shard(self, leaf: str, weight: WeightSlice, section: None) -> None:
        """dt_bias, A_log and the gated norm's weight (this rank's value heads' entries;
        the norm's are the same for every head)."""
        if leaf == "norm_weight":
            fill(self.norm_weight.data, read(weight, [self.v_dim]))
            return
        heads = self.v_heads
        fill(getattr(self, leaf).data, read(weight, [heads.size], heads.ranges))

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        mixed, z, b, a = self.in_proj(x).split(
            [sum(self.sizes[:3]), self.sizes[3], self.sizes[4], self.sizes[5]], dim=-1
        )
        if meta.is_decode:  # one row a sequence, each at its slot (a graph's padding: the spare)
            out = self.step_rows(mixed, a, b, meta.state_slots, meta.seq_lens > 1)
        else:
            out = self.run_sequences(meta, (self.num_v_heads, self.v_dim), mixed, a, b)
        norm = gated_rms_norm_for(x.device)  # over each head: normalized, then gated
        normed = norm(out.to(x.dtype).flatten(1), z, self.norm_weight, self.eps, self.v_dim, True)
        return self.out_proj(normed)

    def step_rows(
        self,
        mixed: torch.Tensor,  # [rows, conv channels]
        a: torch.Tensor,
        b: torch.Tensor,
        slots: torch.Tensor,  # [rows] int64
        has_state: torch.Tensor,  # [rows] bool: False for a one-token prompt (zero states)
    ) -> torch.Tensor:  # [rows, value heads, v_dim] fp32
        """One token per row: each row's states read at its slot and written back."""
        conv = conv_step_at_slots_for(mixed.device)
        conved = conv(mixed, self.conv_state, slots, has_state, self.conv1d.weight, None)
        step = gated_delta_step_for(mixed.device)
        args = (self.A_log, self.dt_bias, self.rule_state, slots, has_state, self.num_k_heads)
        return step(conved, a, b, *args)

    def run_prompts(
        self, conved: torch.Tensor, a: torch.Tensor, b: torch.Tensor, spans: SequenceSpans
    ) -> torch.Tensor:  # [seqs, longest, value heads, v_dim] fp32
        """The padded prompts through the chunked rule (padding neither decays nor writes)."""
        seqs, length = spans.rows.shape
        inputs = delta_rule_inputs(
            conved.flatten(0, 1), a.flatten(0, 1), b.flatten(0, 1), self.A_log, self.dt_bias,
            self.num_k_heads, self.k_dim,
        )  # fmt: skip
        q, k, v, g, beta = (t.unflatten(0, (seqs, length)).transpose(1, 2) for t in inputs)
        pad = ~spans.valid[:, None, :]  # [seqs, 1, length]
        g, beta = g.masked_fill(pad, 0.0), beta.masked_fill(pad, 0.0)
        state = self.rule_state[spans.slots] * spans.has_state[:, None, None, None]
        # o: [seqs, heads, length, v_dim]
        o, state = chunked_rule(q, k, v, g, beta, state, dot_precision(conved.dtype))
        self.rule_state.index_copy_(0, spans.slots, state)
        return o.transpose(1, 2)

    @property
    def walkable(self) -> bool:
        return walkable(self.k_dim, self.v_dim)

    def walk_tokens(
        self, conved: torch.Tensor, a: torch.Tensor, b: torch.Tensor, walk: SequenceWalk
    ) -> torch.Tensor:
        args = (walk.starts, walk.lengths, walk.slots, walk.has_state, self.num_k_heads)
        return gated_delta_tokens(conved, a, b, self.A_log, self.dt_bias, self.rule_state, *args)


class GroupedGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's layer: the same rule, its projections fused by key head. in_proj_qkvz
    holds each key head's q, k, then its group's v and z rows; in_proj_ba its group's b,
    then a. A rank's key heads read their blocks, in the order the plain layout has."""

    def projection(self, k_heads: Section, qkv: list[Section]) -> list[Section]:
        hk, group = k_heads.size, self.v_heads.size // k_heads.size
        widths = [self.k_dim, self.k_dim, group * self.v_dim, group * self.v_dim]
        block = sum(widths)  # a key head's rows of in_proj_qkvz
        qkvz = [
            Section(hk * block, grouped_rows(k_heads, block, sum(widths[:i]), width))
            for i, width in enumerate(widths)
        ]
        ba = [
            Section(hk * 2 * group, grouped_rows(k_heads, 2 * group, o, group)) for o in (0, group)
        ]
        return qkvz + ba
