"""Mamba-2's mixer (the state-space layers of IBM Granite 4.0-H and NVIDIA Nemotron-H), on
the Gated DeltaNet's machinery (gated_delta.py): states by request slot, the same causal
convolution, and the same chunked form and scan over chunks.

Each head h keeps a state S [d_state, head_dim]. With dt = softplus(dt_raw + dt_bias) and
x, B, C from the convolution (B and C shared by the heads of a group), token t does

    S <- exp(dt A_h) S + B_t (dt x_t)^T;   y_t = S^T C_t + D_h x_t

which is the DeltaNet's rule without its delta term: keys B, values dt x, queries C,
log decay dt A, nothing read back before a write. The output is normed with its gate,
y silu(z), by groups of heads (`mamba_n_groups`), then projected.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import SINGLE, TensorParallel
from engine.models.gated_delta import ConvRecurrentLayer, DepthwiseConv, chunked_rule, head_rows
from engine.models.layers import AttentionMetadata, SequenceSpans, SequenceWalk
from engine.models.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    Section,
    WeightSlice,
    read,
    split,
)
from engine.models.weight_copy import fill
from kernels.conv_step import conv_step_at_slots_for
from kernels.gated_delta import walkable
from kernels.gated_norm import gated_rms_norm_for
from kernels.mamba2_step import mamba2_inputs, mamba2_step_for, mamba2_tokens
from kernels.paged_attention import dot_precision

# A mixer's in_proj: one checkpoint tensor, five sections of ours (z, x, B, C, dt).
IN_PROJ = ("in_proj_z", "in_proj_x", "in_proj_b", "in_proj_c", "in_proj_dt")
IN_PROJ_FUSED = {name: ("in_proj", i) for i, name in enumerate(IN_PROJ)}  # a model's FUSED


def split_in_proj(name: str, weight: WeightSlice) -> Iterator[tuple[str, WeightSlice]]:
    """A mixer's in_proj tensor under each of its sections' names (each reads its own
    rows); any other tensor as it is."""
    module, _, leaf = name.rpartition(".")
    if module.rpartition(".")[2] != "in_proj":
        yield name, weight
        return
    owner = module.removesuffix("in_proj")
    yield from ((f"{owner}{part}.{leaf}", weight) for part in IN_PROJ)


@dataclass(frozen=True)
class Mamba2Shape:
    """A Mamba-2 mixer's sizes and switches, under the config's names for them."""

    heads: int
    head_dim: int
    state: int  # d_state: a head's keys and queries (B, C)
    groups: int  # heads sharing one B and C, and one norm group
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool
    dt_limit: tuple[float, float]
    eps: float  # the gated norm's
    norm: str = "gated"  # rms_norm(y silu(z)); "first": rms_norm(y) silu(z); "none": y silu(z)
    out_bias: bool | None = None  # out_proj's bias (None: proj_bias, as in_proj's)

    @classmethod
    def granite(cls, config) -> Mamba2Shape:
        """Granite 4.0-H's (`mamba_*`)."""
        limit = tuple(getattr(config, "time_step_limit", None) or (0.0, float("inf")))
        return cls(
            config.mamba_n_heads,
            config.mamba_d_head,
            config.mamba_d_state,
            config.mamba_n_groups,
            config.mamba_d_conv,
            config.mamba_conv_bias,
            config.mamba_proj_bias,
            (float(limit[0]), float(limit[1])),
            config.rms_norm_eps,
        )

    @classmethod
    def falcon_h1(cls, config) -> Mamba2Shape:
        """Falcon-H1's (`mamba_*`; its norm optional, before or after the gate; out_proj
        biased by `projectors_bias`)."""
        norm = "first" if config.mamba_norm_before_gate else "gated"
        norm = norm if config.mamba_rms_norm else "none"
        return replace(cls.granite(config), norm=norm, out_bias=config.projectors_bias)

    @classmethod
    def mamba2(cls, config) -> Mamba2Shape:
        """A Mamba-2 language model's (`mamba2`: Mamba-Codestral)."""
        limit = tuple(getattr(config, "time_step_limit", None) or (0.0, float("inf")))
        return cls(
            config.num_heads,
            config.head_dim,
            config.state_size,
            config.n_groups,
            config.conv_kernel,
            config.use_conv_bias,
            config.use_bias,
            (float(limit[0]), float(limit[1])),
            config.layer_norm_epsilon,
        )

    @classmethod
    def nemotron_h(cls, config) -> Mamba2Shape:
        """Nemotron-H's (its dt clamped from time_step_min up, as transformers clamps it)."""
        return cls(
            config.mamba_num_heads,
            config.mamba_head_dim,
            config.ssm_state_size,
            config.n_groups,
            config.conv_kernel,
            config.use_conv_bias,
            config.use_bias,
            (float(config.time_step_min), float("inf")),
            config.layer_norm_epsilon,
        )


class Mamba2Mixer(ConvRecurrentLayer):
    """in_proj gives z (the gate), x, B, C (convolved) and dt. Each rank holds a
    contiguous share of the heads; groups split with them where they divide, and one
    group (Granite 4.0-H's) is read whole by every rank, its norm summed across them."""

    def __init__(self, config, shape: Mamba2Shape, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        h, p, n, g = shape.heads, shape.head_dim, shape.state, shape.groups
        if h % g:
            raise ValueError(f"{h} mamba heads are not a multiple of {g} groups")
        if g % tp.size and g != 1:
            raise ValueError(f"{g} mamba groups do not divide across {tp.size} ranks")
        heads = split(h, tp, "mamba_n_heads")
        groups = split(g, tp, "mamba_n_groups") if g % tp.size == 0 else Section(1, ((0, 1),))
        inner, conv_dim = h * p, h * p + 2 * g * n
        self.shape, self.tp = shape, tp
        self.num_heads, self.num_groups = heads.local_size, groups.local_size
        self.norm_shared = groups.local_size * tp.size != g  # one group over every rank
        xbc = [
            Section(conv_dim, head_rows(heads, p)),
            Section(conv_dim, head_rows(groups, n, inner)),
            Section(conv_dim, head_rows(groups, n, inner + g * n)),
        ]
        total = inner + conv_dim + h  # z, then x, B, C, then dt
        proj = [Section(total, head_rows(heads, p))]
        proj += [Section(total, tuple((a + inner, b + inner) for a, b in s.ranges)) for s in xbc]
        proj.append(Section(total, head_rows(heads, 1, inner + conv_dim)))
        self.in_proj = ColumnParallelLinear(config.hidden_size, proj, bias=shape.proj_bias)
        self.sizes = [s.local_size for s in proj]
        self.conv1d = DepthwiseConv(xbc, shape.conv_kernel, shape.conv_bias)
        self.heads = heads
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.D = nn.Parameter(torch.empty(self.num_heads))
        if shape.norm != "none":
            self.norm_weight = nn.Parameter(torch.empty(self.num_heads * p))
        self.eps = shape.eps
        out_bias = shape.proj_bias if shape.out_bias is None else shape.out_bias
        self.out_proj = RowParallelLinear(inner, config.hidden_size, out_bias, tp)
        self.conv_state = self.ssm_state = torch.empty(0)  # by slot: see RecurrentLayer

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        channels, kernel = self.conv1d.weight.shape
        shape = (self.num_heads, self.shape.state, self.shape.head_dim)
        return {"conv_state": ((channels, kernel - 1), None), "ssm_state": (shape, torch.float32)}

    def load_shard(self, leaf: str, weight: WeightSlice, section: None) -> None:
        """dt_bias, A_log, D (an entry a head) and the norm's weight (head_dim a head)."""
        size = self.shape.head_dim if leaf == "norm_weight" else 1
        rows = head_rows(self.heads, size)
        fill(getattr(self, leaf).data, read(weight, [self.heads.size * size], rows))

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        z, xbc, dt = self.in_proj(x).split(
            [self.sizes[0], sum(self.sizes[1:4]), self.sizes[4]], dim=-1
        )
        if meta.is_decode:
            y = self.step_rows(xbc, dt, meta.state_slots, meta.seq_lens > 1)
        else:
            y = self.run_sequences(meta, (self.num_heads, self.shape.head_dim), xbc, dt)
        return self.out_proj(self.gated_norm(y.to(x.dtype), z))

    def step_rows(
        self,
        xbc: torch.Tensor,  # [rows, conv channels]
        dt: torch.Tensor,  # [rows, heads]
        slots: torch.Tensor,  # [rows] int64
        has_state: torch.Tensor,  # [rows] bool: False for a one-token prompt (zero states)
    ) -> torch.Tensor:  # [rows, heads, head_dim] fp32
        """One token per row: each row's states read at its slot and written back."""
        conv = conv_step_at_slots_for(xbc.device)
        conved = conv(xbc, self.conv_state, slots, has_state, self.conv1d.weight, self.conv1d.bias)
        step = mamba2_step_for(xbc.device)
        args = (self.A_log, self.dt_bias, self.D, self.ssm_state, slots, has_state)
        return step(conved, dt, *args, self.shape.dt_limit)

    def run_prompts(
        self, conved: torch.Tensor, dt: torch.Tensor, spans: SequenceSpans
    ) -> torch.Tensor:  # [seqs, longest, heads, head_dim] fp32
        """The padded prompts through the chunked rule (padding neither decays nor writes)."""
        x, b, c, dt, log_decay = mamba2_inputs(  # [seqs, longest, heads, ...], fp32
            conved, dt, self.A_log, self.dt_bias, self.shape.state, self.shape.dt_limit,
            self.num_groups,
        )  # fmt: skip
        pad = ~spans.valid[:, :, None]
        dt, log_decay = dt.masked_fill(pad, 0.0), log_decay.masked_fill(pad, 0.0)
        v = dt[..., None] * x
        q, k, v = (t.transpose(1, 2) for t in (c, b, v))  # [seqs, heads, longest, ...]
        state = self.ssm_state[spans.slots] * spans.has_state[:, None, None, None]
        o, state = chunked_rule(
            q, k, v, log_decay.transpose(1, 2), None, state, dot_precision(conved.dtype)
        )
        self.ssm_state.index_copy_(0, spans.slots, state)
        return o.transpose(1, 2) + self.D.float()[:, None] * x

    @property
    def walkable(self) -> bool:
        return walkable(self.shape.state, self.shape.head_dim)

    def walk_tokens(
        self, conved: torch.Tensor, dt: torch.Tensor, walk: SequenceWalk
    ) -> torch.Tensor:
        args = (self.A_log, self.dt_bias, self.D, self.ssm_state, walk.starts, walk.lengths)
        return mamba2_tokens(conved, dt, *args, walk.slots, walk.has_state, self.shape.dt_limit)

    def gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """weight * rms_norm(y silu(z)) over each group's heads, as transformers rounds it
        (or the shape's other `norm`); one group across ranks sums its squares across them."""
        y = y.flatten(1)
        if self.shape.norm == "none":
            return (y.float() * F.silu(z.float())).to(y.dtype)
        first = self.shape.norm == "first"
        if not self.norm_shared:
            group = y.shape[1] // self.num_groups
            return gated_rms_norm_for(y.device)(y, z, self.norm_weight, self.eps, group, first)
        h = y.float() if first else y.float() * F.silu(z.float())
        squares = self.tp.all_reduce(h.pow(2).sum(-1, keepdim=True))
        normed = (h * torch.rsqrt(squares / (h.shape[-1] * self.tp.size) + self.eps)).to(y.dtype)
        if first:
            return (self.norm_weight * normed * F.silu(z.float())).to(y.dtype)
        return self.norm_weight * normed
