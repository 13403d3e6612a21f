"""Host-to-device transport: pinned staging buffers, fences, and the sampled ids' way back.

A step's metadata is written with numpy into a pinned host buffer and sent
with one non-blocking copy; the sampled ids come back the same way. (A decode
graph moves both by kernels instead, only the words its batch size uses:
kernels/host_copy.py.) A pinned buffer is not rewritten before the copy that
reads it has run: every buffer comes twice on CUDA (alternate steps use
alternate copies), each followed by a Fence.
"""

from __future__ import annotations

import time

import numpy as np
import torch


class StagedFields:
    """Named integer arrays (int64 or int32) packed in one pinned host buffer, with numpy
    views for writing, and their device twin (the same tensor on CPU): a step's
    metadata travels in one copy, whatever the fields' dtypes.

    Offsets never change, so a CUDA graph captured on the device views sees every
    later step's values. `device_only` fields follow the staged ones on the device
    and are never overwritten by a send (on CPU they are simply more of the buffer).
    On CUDA there are `copies` host buffers (`nps[i]` writes buffer i, `send(i)`
    sends it), so a step can be written while the last one's copy is still queued."""

    ALIGN = 16  # bytes: every field starts where any integer view of it may start

    def __init__(
        self,
        fields: dict[str, tuple[int, torch.dtype]],  # name -> (size, dtype)
        device: torch.device,
        device_only: dict[str, tuple[int, torch.dtype]] | None = None,
        copies: int = 1,
    ) -> None:
        on_cuda = device.type == "cuda"
        layout: dict[str, tuple[int, int, torch.dtype]] = {}  # name -> (byte offset, size, dtype)
        offset = staged = 0
        for name, (size, dtype) in {**fields, **(device_only or {})}.items():
            layout[name] = (offset, size, dtype)
            offset += -(-size * dtype.itemsize // self.ALIGN) * self.ALIGN
            if name in fields:
                staged = offset
        self.hosts = [
            torch.zeros(staged if on_cuda else offset, dtype=torch.uint8, pin_memory=on_cuda)
            for _ in range(copies if on_cuda else 1)
        ]
        self.device = (
            torch.zeros(offset, dtype=torch.uint8, device=device) if on_cuda else self.hosts[0]
        )
        # The whole buffer as int64: int64 fields are addressed by `offset` in it.
        self.words = self.device.view(torch.int64)
        self.nps: list[dict[str, np.ndarray]] = [{} for _ in self.hosts]
        self.gpu: dict[str, torch.Tensor] = {}
        self.offset: dict[str, int] = {}  # in elements of the field's dtype
        for name, (start, size, dtype) in layout.items():
            end = start + size * dtype.itemsize
            if name in fields:
                np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
                for host, views in zip(self.hosts, self.nps):
                    views[name] = host.numpy()[start:end].view(np_dtype)
            self.gpu[name] = self.device[start:end].view(dtype)
            self.offset[name] = start // dtype.itemsize
        self.np = self.nps[0]
        self.staged = self.device[:staged]
        self.layout = layout

    def word_ranges(self, lengths: dict[str, int]) -> list[tuple[int, int]]:
        """(first word, words) of each named field's first `n` elements, in whole int64
        words of the buffer (a field starts on a word and its padding ends on one)."""
        ranges = []
        for name, n in lengths.items():
            start, size, dtype = self.layout[name]
            assert n <= size
            ranges.append((start // 8, -(-n * dtype.itemsize // 8)))
        return ranges

    def send(self, copy: int = 0) -> None:
        if self.device is not self.hosts[0]:
            self.staged.copy_(self.hosts[copy], non_blocking=True)


class WaitClock:
    """Seconds the host spent blocked on the device (for profiling and the stats line)."""

    def __init__(self) -> None:
        self.seconds = 0.0


class Fence:
    """A CUDA event that remembers being seen complete since it was last recorded,
    so that waiting on it again costs nothing (a query is a driver call)."""

    def __init__(self, clock: WaitClock) -> None:
        self.event = torch.cuda.Event()
        self.pending = False
        self.clock = clock

    def record(self, stream: torch.cuda.Stream) -> None:
        self.event.record(stream)
        self.pending = True

    def ready(self) -> bool:
        return not self.pending or self.event.query()

    def wait(self) -> None:
        if not self.pending:
            return
        # query() first: synchronize() releases the GIL even when nothing is pending.
        if not self.event.query():
            start = time.perf_counter()
            self.event.synchronize()
            self.clock.seconds += time.perf_counter() - start
        self.pending = False


class SampledIds:
    """A step's sampled ids on their way to the host; numpy() waits for them."""

    def __init__(self, array: np.ndarray, done: Fence | None = None) -> None:
        self.array, self.done = array, done  # array: a view of the pinned buffer

    def ready(self) -> bool:
        return self.done is None or self.done.ready()

    def numpy(self) -> np.ndarray:
        """The ids (a view of a buffer reused two steps on: copy what is kept)."""
        if self.done is not None:
            self.done.wait()
        return self.array

    def tolist(self) -> list[int]:
        return self.numpy().tolist()


class SampledTransport:
    """Where a step's sampled ids live: a device buffer the next step's inputs are
    gathered from (a StagedFields device-only field), and two pinned host buffers
    they are copied to, used by alternate steps."""

    def __init__(self, device_ids: torch.Tensor, device: torch.device, clock: WaitClock) -> None:
        n = device_ids.numel()
        on_cuda = device.type == "cuda"
        # Views by row count, made once: slicing a tensor costs host time every step.
        self.device_rows = [device_ids[:k] for k in range(n + 1)]
        # On the CPU the "device" buffer is host memory: written through numpy, which
        # costs less host time per call than a torch copy.
        self.device_np = device_ids.numpy() if not on_cuda else None
        self.hosts = [
            torch.zeros(n, dtype=torch.int64, pin_memory=True) for _ in range(2 if on_cuda else 0)
        ]
        self.host_rows = [[host[:k] for k in range(n + 1)] for host in self.hosts]
        self.host_np = [host.numpy() for host in self.hosts]
        self.done = [Fence(clock) for _ in self.hosts]
        self.stream = torch.cuda.current_stream(device) if on_cuda else None

    def keep(self, token_ids: torch.Tensor, parity: int) -> SampledIds:
        """Keep a step's ids on the device for the next step's inputs, and start their
        copy to the host (into buffer `parity`)."""
        k = token_ids.numel()  # len() of a tensor costs more
        rows = self.device_rows[k]
        same = token_ids.data_ptr() == rows.data_ptr()
        if self.device_np is not None:  # CPU: nothing to wait for
            ids = token_ids.numpy()
            if same:  # the rows themselves, rewritten by the next step: a copy to read
                return SampledIds(ids.copy())
            self.device_np[:k] = ids
            return SampledIds(ids)
        if not same:
            rows.copy_(token_ids)
        self.host_rows[parity][k].copy_(rows, non_blocking=True)
        done = self.done[parity]
        done.record(self.stream)
        return SampledIds(self.host_np[parity][:k], done)
