"""Megatron-style tensor-parallel layers, and reading each rank's slices of a checkpoint.

A column-parallel linear splits its output features: each rank holds its rows of every
section (q, k, v; gate, up) and needs no communication, because the row-parallel linear
after it splits its input features the same way and sums the ranks' partial products
with one all_reduce. The vocabulary is split across ranks for the embedding (rows out of
the rank's range masked to zero, then all_reduce) and for the LM head (logits gathered).

With `SINGLE` (size 1) every layer holds the whole matrix and computes exactly what
nn.Linear / nn.Embedding compute: the collectives are Python no-ops.

Weights are read through `WeightSlice` (safetensors' lazy slice, or a tensor already in
memory): a rank reads only its own rows or columns from the file.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import SINGLE, TensorParallel
from engine.models.weight_copy import fill, fill_quantized
from kernels.fp8 import FP8_DTYPE
from kernels.linear import dense
from kernels.splits import SplitKPartials

if TYPE_CHECKING:
    from engine.models.lora import LoRALayer

Ranges = tuple[tuple[int, int], ...]  # [start, stop) index ranges along one dimension


class WeightSlice(Protocol):
    """A checkpoint tensor not yet read: safetensors' `get_slice(name)`."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor: ...


def renamed(
    weights: Iterable[tuple[str, WeightSlice]], renames: dict[str, str]
) -> Iterator[tuple[str, WeightSlice]]:
    """The checkpoint's tensors, each name with every `renames` key replaced by its value."""
    for name, weight in weights:
        for old, new in renames.items():
            name = name.replace(old, new)
        yield name, weight


class TensorSlice:
    """A tensor already in memory, read as a WeightSlice."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        return self.tensor[index]


class Transposed:
    """A 2-D checkpoint tensor read as its transpose (GPT-2's Conv1D stores [in, out])."""

    def __init__(self, weight: WeightSlice) -> None:
        self.weight = weight

    def get_shape(self) -> list[int]:
        return self.weight.get_shape()[::-1]

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        rows, cols = index
        return self.weight[cols, rows].t()


def read(
    weight: WeightSlice, shape: Sequence[int], ranges: Ranges | None = None, dim: int = 0
) -> torch.Tensor:
    """`ranges` of `weight` along `dim`, concatenated (all of it when None), after checking
    that the checkpoint's tensor has the full `shape` the config implies."""
    check_shape(weight, shape)
    index = [slice(None)] * len(shape)
    if ranges is None:
        return weight[tuple(index)]
    parts = []
    for start, stop in merged(ranges):
        index[dim] = slice(start, stop)
        parts.append(weight[tuple(index)])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def check_shape(weight: WeightSlice, shape: Sequence[int]) -> None:
    if list(weight.get_shape()) != list(shape):
        raise ValueError(f"shape {tuple(weight.get_shape())}, expected {tuple(shape)}")


def merged(ranges: Ranges) -> Ranges:
    """Adjacent ranges joined, so a contiguous shard is one read."""
    out: list[tuple[int, int]] = []
    for start, stop in ranges:
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], stop)
        else:
            out.append((start, stop))
    return tuple(out)


def load_weight(
    module: nn.Module, leaf: str, weight: WeightSlice, name: str, section: object = None
) -> None:
    """Fill `module.<leaf>` with this rank's part of the checkpoint tensor `name`: through
    the module's `load_shard` where it is sharded, else the whole tensor (replicated)."""
    try:
        if hasattr(module, "load_shard"):
            module.load_shard(leaf, weight, section)
        else:
            fill_rows(module, leaf, slice(None), read(weight, getattr(module, leaf).shape))
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from e


def fill_rows(module: nn.Module, leaf: str, rows: slice, src: torch.Tensor) -> None:
    """module.<leaf>[rows] = src. A weight kept in e4m3 from the start (the loader's
    `quantize_linears_at_load`) takes src quantized per row, each row's scale going to
    `weight_scale` beside it."""
    param = getattr(module, leaf).data
    if param.dtype == FP8_DTYPE:
        fill_quantized(param[rows], module.weight_scale[rows], src, module.load_dtype)
    else:
        fill(param[rows] if param.dim() else param, src)  # a scalar (Apertus's xIELU beta)


def scale_rows_(linear: nn.Module, factor: float) -> None:
    """linear's output rows times factor (its weight's, or its scales' once in e4m3; and
    its bias)."""
    fp8 = linear.weight.dtype == FP8_DTYPE
    (linear.weight_scale if fp8 else linear.weight).mul_(factor)
    if getattr(linear, "bias", None) is not None:
        linear.bias.mul_(factor)


def permute_rows_(linear: nn.Module, rows: slice, order: torch.Tensor) -> None:
    """linear's output rows[rows] put in `order` (indices into that range), weight, bias
    and (once in e4m3) scales alike."""
    for tensor in (linear.weight, linear.bias, getattr(linear, "weight_scale", None)):
        if tensor is None:
            continue
        part = tensor.data[rows]
        part = part.view(torch.uint8) if part.dtype == FP8_DTYPE else part  # no fp8 gather
        part.copy_(part[order])


@dataclass(frozen=True)
class Section:
    """One part of a fused weight (q, k or v; gate or up) as the checkpoint holds it:
    `size` rows in all, of which this rank holds `ranges`, in order."""

    size: int
    ranges: Ranges

    @property
    def local_size(self) -> int:
        return sum(stop - start for start, stop in self.ranges)


def split(n: int, tp: TensorParallel, what: str) -> Section:
    """n rows (of the config's `what`) split evenly: this rank's contiguous share."""
    if n % tp.size:
        raise ValueError(f"{what} {n} does not divide across {tp.size} tensor-parallel ranks")
    start, length = tp.shard(n)
    return Section(n, ((start, start + length),))


def kv_heads_of_rank(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> list[int]:
    """The checkpoint's kv head behind each of this rank's kv heads, in order.

    q head h reads kv head h // group (group = num_heads / num_kv_heads). A rank holds q
    heads [start, start + n), and the attention kernels read kv head j // (n / local kv
    heads) for local q head j, so a rank's q heads form local groups of gcd(group, n)
    consecutive heads, one kv head each: the kv heads split evenly when num_kv_heads %
    size == 0, one head replicated when num_kv_heads < size divides it, and otherwise a
    kv head repeated where a rank's q heads split its group (6 q / 3 kv heads over 2
    ranks: [0, 0, 1] and [1, 2, 2])."""
    if num_heads % tp.size:
        raise ValueError(
            f"{num_heads} attention heads do not divide across {tp.size} tensor-parallel ranks"
        )
    group = num_heads // num_kv_heads
    start, n = tp.shard(num_heads)
    local_group = math.gcd(group, n)
    return [(start + j * local_group) // group for j in range(n // local_group)]


@dataclass(frozen=True)
class HeadShard:
    """This rank's attention heads and the rows of q, k and v that hold them."""

    num_heads: int  # this rank's q heads
    kv_heads: tuple[int, ...]  # the checkpoint's kv head behind each local kv head
    sections: tuple[Section, Section, Section]  # q, k, v

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)


def head_shard(num_heads: int, num_kv_heads: int, head_dim: int, tp: TensorParallel) -> HeadShard:
    kv_heads = tuple(kv_heads_of_rank(num_heads, num_kv_heads, tp))
    kv_rows = tuple((h * head_dim, (h + 1) * head_dim) for h in kv_heads)
    kv = Section(num_kv_heads * head_dim, kv_rows)
    q = split(num_heads * head_dim, tp, "q rows")
    return HeadShard(num_heads // tp.size, kv_heads, (q, kv, kv))


class ColumnParallelLinear(nn.Linear):
    """Output features split: this rank's rows of each section, sections in order (its q,
    k, v heads; its gate rows then its up rows). The forward is nn.Linear's product
    (`dense`: the split-K kernel at decode batch sizes on CUDA)."""

    def __init__(self, in_features: int, sections: Sequence[Section], bias: bool) -> None:
        super().__init__(in_features, sum(s.local_size for s in sections), bias)
        self.sections = tuple(sections)
        self.lora: LoRALayer | None = None  # LoRA adapters' deltas (engine/models/lora.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is not None:
            return self.lora(x, self.weight, self.bias)
        return dense(x, self.weight, self.bias)

    def load_shard(self, leaf: str, weight: WeightSlice, section: int | None) -> None:
        """section None: one checkpoint tensor holding every section (Phi-3's qkv_proj,
        GPT-2's c_attn); else the checkpoint's tensor of that section alone."""
        tail = [self.in_features] if leaf == "weight" else []
        if section is None:
            offset, ranges = 0, []
            for s in self.sections:
                ranges += [(offset + a, offset + b) for a, b in s.ranges]
                offset += s.size
            fill_rows(self, leaf, slice(None), read(weight, [offset, *tail], tuple(ranges)))
            return
        s = self.sections[section]
        start = sum(x.local_size for x in self.sections[:section])
        rows = slice(start, start + s.local_size)
        fill_rows(self, leaf, rows, read(weight, [s.size, *tail], s.ranges))


class RowParallelLinear(nn.Linear):
    """Input features split (the column-parallel layer before it left each rank its
    slice): the ranks' partial products summed by one all_reduce. The bias is added once:
    rank 0 holds it, the other ranks zeros (one addmm either way)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, tp: TensorParallel = SINGLE
    ) -> None:
        self.in_start, local = tp.shard(in_features)
        super().__init__(local, out_features, bias)
        self.tp = tp
        self.full_in_features = in_features
        self.lora: LoRALayer | None = None  # partial deltas, summed with the product
        # Set where a residual add alone takes the output: at one rank a split-K launch
        # may then return its splits unsummed, for that add to sum (SplitKPartials).
        self.sum_later = False

    def forward(self, x: torch.Tensor) -> torch.Tensor | SplitKPartials:
        if self.lora is not None:
            return self.tp.all_reduce(self.lora(x, self.weight, self.bias))
        if self.sum_later and self.tp.size == 1:
            return dense(x, self.weight, self.bias, defer=True)
        return self.tp.all_reduce(dense(x, self.weight, self.bias))

    def load_shard(self, leaf: str, weight: WeightSlice, section: None) -> None:
        if leaf == "bias":
            bias = read(weight, [self.out_features])
            self.bias.data.copy_(bias if self.tp.is_driver else torch.zeros_like(bias))
            return
        cols = ((self.in_start, self.in_start + self.in_features),)
        shard = read(weight, [self.out_features, self.full_in_features], cols, dim=1)
        fill_rows(self, leaf, slice(None), shard)


def vocab_rows(vocab_size: int, multiple: int, tp: TensorParallel) -> tuple[int, int]:
    """(first row, rows) of this rank's share of the vocabulary, padded to `multiple` * size
    rows so that every rank's share is a whole number of `multiple`s."""
    padded = -(-vocab_size // (multiple * tp.size)) * multiple * tp.size
    return tp.shard(padded)


class VocabParallelEmbedding(nn.Embedding):
    """Embedding rows split across ranks: each rank looks up the ids in its range, the
    others give zeros, and all_reduce sums the one non-zero row. nn.Embedding at size 1."""

    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel = SINGLE) -> None:
        self.vocab_start, rows = vocab_rows(vocab_size, 1, tp)
        super().__init__(rows, hidden)
        self.vocab_size = vocab_size
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [num_tokens, hidden]
        return self.tp.all_reduce(x.masked_fill_(outside[:, None], 0))

    def load_shard(self, leaf: str, weight: WeightSlice, section: None) -> None:
        """This rank's rows of a [vocab, hidden] matrix (LMHead's too); rows past the
        vocabulary stay zero."""
        param, start = self.weight.data, self.vocab_start
        shape = [self.vocab_size, param.shape[1]]
        stop = min(start + param.shape[0], self.vocab_size)
        param.zero_()
        if stop > start:
            fill(param[: stop - start], read(weight, shape, ((start, stop),)))
        else:  # a small vocabulary over many ranks: all of this rank's rows are padding
            check_shape(weight, shape)
