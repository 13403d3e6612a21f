"""Small all-reduces over peer memory: torch's symmetric-memory one-shot kernel.

Every rank of a node maps every other rank's copy of one buffer (torch's symmetric
memory: CUDA peer mappings, no NVLink multicast). One kernel copies the rank's tensor
into its buffer, meets the other ranks at a barrier on the GPU, and sums all the
buffers itself; NCCL's ring takes several hops of latency for the same few KB. A
decode step makes two such reductions a layer (a token's hidden state per row), so at
batch 1 their latency is most of what tensor parallelism adds. Past a size that
depends on the group NCCL's bandwidth wins again and takes those tensors.

The kernel's barriers wait for the other ranks' flags with no timeout, and NCCL's
abort does not reach them: when a rank dies, `unblock_until_drained` raises the dead
ranks' flags from the host, so that this rank's pending kernels finish (with sums that
no one will read) and the engine thread's wait returns, as it does after NCCL's abort.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

logger = logging.getLogger("pagoda.engine")

# Largest tensor the one-shot kernel sums, by group size: where it stopped beating NCCL
# inside CUDA graphs on H200s (2 ranks: 21.6 against 29.4 us at 2 MiB; 4 ranks: 19.6
# against 21.4 us at 1 MiB, slower at 2 MiB). Larger groups read more peers per element:
# half of 4's, not measured.
MAX_BYTES = {2: 2 << 20, 4: 1 << 20}
MAX_BYTES_LARGER = 512 << 10
UNBLOCK_INTERVAL_S = 0.002

_LIVE: weakref.WeakSet[OneShotAllReduce] = weakref.WeakSet()  # this process's, for unblocking
# torch (2.11) numbers a process's symmetric-memory rendezvous, and ranks meet at the
# store keys their numbers name: only ranks that have made as many before can meet. A
# new engine's workers are new processes, so an engine made after another in the same
# process cannot (tp_group.py then leaves its sums to NCCL).
_rendezvous_made = 0


@dataclass(frozen=True, eq=False)
class OneShotAllReduce:
    buffer: torch.Tensor  # uint8, symmetric: every rank of the group maps every copy
    handle: Any  # torch's _SymmetricMemory for buffer: peers' buffers and flags
    group_name: str
    max_bytes: int
    # For unblocking, made while nothing waits: creating a stream, or loading the fill
    # kernel, can wait behind a kernel stranded at a barrier.
    stream: torch.cuda.Stream
    drained: torch.cuda.Event  # recorded after the work queued when unblocking began
    arrived: list[torch.Tensor]  # per peer: its arrival flags in this rank's signal pad
    taken: list[torch.Tensor]  # per peer: this rank's arrival flags in the peer's pad

    @classmethod
    def create(cls, group: ProcessGroup, size: int, device: torch.device) -> OneShotAllReduce:
        """A collective: every rank of `group` calls it, on its own device."""
        import torch.distributed._symmetric_memory as symm_mem

        global _rendezvous_made
        max_bytes = MAX_BYTES.get(size, MAX_BYTES_LARGER)
        buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        try:
            handle = symm_mem.rendezvous(buffer, group.group_name)
        finally:
            _rendezvous_made += 1
        rank, world = handle.rank, handle.world_size

        def flags(owner: int) -> torch.Tensor:  # [block, rank]: torch's signal pad layout
            pad = handle.get_signal_pad(owner, dtype=torch.int32)
            return pad[: pad.numel() // world * world].view(-1, world)

        mine, peers = flags(rank), [peer for peer in range(world) if peer != rank]
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):  # the fill kernel for such columns, loaded now
            torch.zeros_like(mine)[:, 0].fill_(1)
        stream.synchronize()
        arrived = [mine[:, peer] for peer in peers]
        taken = [flags(peer)[:, rank] for peer in peers]
        drained = torch.cuda.Event()
        one_shot = cls(buffer, handle, group.group_name, max_bytes, stream, drained, arrived, taken)
        _LIVE.add(one_shot)
        return one_shot

    def fits(self, x: torch.Tensor) -> bool:
        return (
            x.dtype in (torch.bfloat16, torch.float32)  # the kernel's types
            and x.nbytes <= self.max_bytes
            and x.is_contiguous()
            and x.device == self.buffer.device
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the group, in a new tensor (x is left as it was)."""
        symm = self.buffer[: x.nbytes].view(x.dtype).view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(symm, x, "sum", self.group_name)

    def unblock_peers(self) -> None:
        """Every other rank marked as arrived at each of this rank's barriers, and this
        rank's flags in theirs as taken: its kernels go on as if they had been there."""
        with torch.cuda.stream(self.stream):
            for flags in self.arrived:
                flags.fill_(1)
            for flags in self.taken:
                flags.fill_(0)


def rendezvous_made() -> int:
    """How many one-shot all-reduces this process has set up (or tried to)."""
    return _rendezvous_made


def unblock_until_drained(timeout_s: float) -> threading.Thread | None:
    """After a rank's death: keep this process's one-shot kernels unblocked (from the
    thread returned) until the device work queued now has ended, or `timeout_s`. A
    step's graph holds several of them, each stranded in turn, and NCCL's abort of the
    collectives queued behind them may take a while: stopping at the engine's shutdown
    is too soon."""
    live = list(_LIVE)
    if not live:
        return None
    for one_shot in live:  # the engine's stream: the current one of its device
        one_shot.drained.record(torch.cuda.current_stream(one_shot.buffer.device))

    def loop() -> None:
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if all(one_shot.drained.query() for one_shot in live):
                    return
                for one_shot in live:
                    one_shot.unblock_peers()
                time.sleep(UNBLOCK_INTERVAL_S)
        except Exception:
            logger.exception("unblocking the one-shot all-reduces failed")

    thread = threading.Thread(target=loop, name="pagoda-one-shot-unblock", daemon=True)
    thread.start()
    return thread
