"""Checkpoint tensors onto the GPU through pinned buffers.

A checkpoint tensor is a view of the file's memory mapping; `param.copy_(view)` is a
pageable host-to-device copy, which the driver does in small synchronous pieces while
the mapping's pages fault in one by one. Copied instead into a pinned buffer (a CPU
copy, which torch spreads over its threads) and from there asynchronously, each piece's
transfer runs while the next one is read, at the link's full rate. A few buffers in
turn: a buffer is written again only once its last transfer is done.

Every weight copy of the model code goes through `fill`; inside `staged_copies` (the
loader's, while one model loads on a CUDA device) it takes this path, elsewhere it is
`dst.copy_(src)`. `fill_quantized` is its form for weights kept in e4m3 from the start
(`--quantization fp8`): rows quantized as they arrive, never held in the model dtype.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

from kernels.fp8 import quantize_per_channel

BUFFER_BYTES = 64 << 20
NUM_BUFFERS = 4


class PinnedStager:
    """Host-to-device copies through a ring of pinned buffers, on the current stream."""

    def __init__(self) -> None:
        self.buffers = [
            torch.empty(BUFFER_BYTES, dtype=torch.uint8, pin_memory=True)
            for _ in range(NUM_BUFFERS)
        ]
        self.done = [torch.cuda.Event() for _ in range(NUM_BUFFERS)]
        self.next = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst (on the device) = src (on the host, any layout), in pieces of whole rows."""
        row_bytes = src[0].numel() * src.element_size() if src.dim() and src.numel() else 0
        if not 0 < row_bytes <= BUFFER_BYTES:
            dst.copy_(src)  # a scalar, nothing, or a row larger than a buffer
            return
        rows = BUFFER_BYTES // row_bytes
        stream = torch.cuda.current_stream(dst.device)  # where the copies below run
        for start in range(0, src.shape[0], rows):
            part = src[start : start + rows]
            i, self.next = self.next, (self.next + 1) % NUM_BUFFERS
            self.done[i].synchronize()  # its previous transfer has read it
            nbytes = part.numel() * part.element_size()
            staged = self.buffers[i][:nbytes].view(part.dtype).view(part.shape)
            staged.copy_(part)
            dst[start : start + rows].copy_(staged, non_blocking=True)
            self.done[i].record(stream)

    def finish(self) -> None:
        for event in self.done:
            event.synchronize()


_stager: contextvars.ContextVar[PinnedStager | None] = contextvars.ContextVar(
    "pagoda_weight_stager", default=None
)


@contextlib.contextmanager
def staged_copies(device: torch.device) -> Iterator[None]:
    """`fill` stages host tensors through pinned buffers while this is open (CUDA only)."""
    if device.type != "cuda":
        yield
        return
    stager = PinnedStager()
    token = _stager.set(stager)
    try:
        yield
    finally:
        _stager.reset(token)
        stager.finish()  # the buffers outlive every transfer from them


def fill(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src), staged when a load is open and this is a host-to-device copy."""
    stager = _stager.get()
    if stager is None or dst.device.type != "cuda" or src.device.type != "cpu":
        dst.copy_(src)
    else:
        stager.copy(dst, src)


def fill_quantized(
    dst: torch.Tensor,  # [..., K] e4m3
    scale: torch.Tensor,  # dst.shape[:-1] fp32: each row's scale
    src: torch.Tensor,  # dst's rows, on the host or the device
    dtype: torch.dtype,  # the model dtype they are quantized from
) -> None:
    """dst, scale = src quantized per row (a row's scale is its amax / 448), from `dtype`:
    the bytes and scales that loading src in `dtype`, then quantizing it, would give."""
    rows = torch.empty(src.shape, dtype=dtype, device=dst.device)
    fill(rows, src)
    q, s = quantize_per_channel(rows.reshape(-1, rows.shape[-1]))
    dst.copy_(q.view(dst.shape))
    scale.copy_(s.view(scale.shape))
