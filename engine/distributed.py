"""Tensor parallelism's process group as the model layers see it.

One `TensorParallel` per process: its rank, the group's size and the
`torch.distributed` process group (NCCL on CUDA, gloo on CPU). The layers shard
their weights by `rank` and reduce through `all_reduce`; with size 1 every
collective is the identity and no process group exists, so a single GPU pays
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: ProcessGroup | None = None  # None when size == 1

    @property
    def is_driver(self) -> bool:
        """Rank 0 schedules, samples and owns the InputBatch."""
        return self.rank == 0

    def shard(self, n: int) -> tuple[int, int]:
        """(start, length) of this rank's share of n rows; n must divide evenly."""
        if n % self.size:
            raise ValueError(f"{n} does not divide across {self.size} tensor-parallel ranks")
        part = n // self.size
        return self.rank * part, part

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x


SINGLE = TensorParallel()
