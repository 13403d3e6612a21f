"""Copies between pinned host memory and the device as kernels, for the decode graph.

A decode step's graph opens with its metadata coming in from pinned host memory and
closes with its sampled ids going out. As memcpy nodes, each hands off between the copy
engine and the compute queue, and the graph's first kernel starts well after the copy
in has ended. A kernel reads (or writes) the pinned memory itself over the bus, which
the device maps, and only the words the step uses: the prefix of each staged field that
a batch of its size fills. Loads from host memory bypass the caches (".cv"), as the
host rewrites its buffers between launches; stores to host memory are visible to the
host once the kernel has completed (an event it waits on, as for a copy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK = 256  # 8-byte words a program moves


@triton.jit
def _copy_segments_kernel(src_ptr, dst_ptr, segments_ptr, BLOCK: tl.constexpr):
    # Program (segment, block): words [start + block * BLOCK, ...) of that segment.
    start = tl.load(segments_ptr + 2 * tl.program_id(0))
    length = tl.load(segments_ptr + 2 * tl.program_id(0) + 1)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < length
    words = tl.load(src_ptr + start + offs, mask=mask, cache_modifier=".cv")
    tl.store(dst_ptr + start + offs, words, mask=mask)


@dataclass(frozen=True)
class Segments:
    """Word ranges of a buffer to copy, made before a graph captures their copy."""

    table: torch.Tensor  # [S, 2] int64 on the device: (first word, words) a row
    longest: int  # the most words of one range: the launch grid's second axis

    @classmethod
    def of(cls, ranges: list[tuple[int, int]], device: torch.device) -> Segments:
        table = torch.tensor(ranges, dtype=torch.int64).reshape(-1, 2).to(device)
        return cls(table, max((n for _, n in ranges), default=0))


def copy_segments(dst: torch.Tensor, src: torch.Tensor, segments: Segments) -> None:
    """dst[s:s + n] = src[s:s + n] for each range (s, n) of segments: int64 words, src in
    pinned host memory and dst on the device (both on the CPU under Triton's
    interpreter). One launch, CUDA-graph safe."""
    assert src.dtype == dst.dtype == torch.int64 and src.shape == dst.shape
    if segments.longest == 0:
        return
    grid = (len(segments.table), triton.cdiv(segments.longest, BLOCK))
    _copy_segments_kernel[grid](src, dst, segments.table, BLOCK=BLOCK)


@triton.jit
def _to_host_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def copy_to_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for 1-D int64 tensors, src on the device and dst in pinned host
    memory (both on the CPU under Triton's interpreter). One launch, CUDA-graph safe."""
    assert src.dtype == dst.dtype == torch.int64 and src.shape == dst.shape and src.dim() == 1
    assert src.is_contiguous() and dst.is_contiguous()
    n = src.numel()
    if n:
        _to_host_kernel[(triton.cdiv(n, BLOCK),)](src, dst, n, BLOCK=BLOCK)
