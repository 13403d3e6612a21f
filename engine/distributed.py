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


class WorkerFailed(RuntimeError):
    """A tensor-parallel rank died or failed to start, or a step failed (the ranks may
    no longer agree on which collectives ran): the engine cannot go on. Here, not with
    the group's code: the API processes catch it and never import torch."""


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

    def gather_logits(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, vocab / size] per rank -> [rows, vocab]: every rank's slice side by side.

        Only rank 0 samples, but this is an all_gather, not a gather, so every rank gets
        the full logits (the others ignore them): the decode graph captures the LM head,
        and NCCL's all-gather is a collective CUDA graphs capture, where torch runs a
        gather on NCCL as point-to-point send/recv, whose capture fails in torch
        (pytorch/pytorch#133984). Rank 0 receives the same bytes either way."""
        if self.size == 1:
            return x
        import torch
        import torch.distributed as dist

        rows, part = x.shape
        out = torch.empty(self.size * rows, part, dtype=x.dtype, device=x.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, x.contiguous(), group=self.group)  # [size * rows, part], rank-major
        return out.view(self.size, rows, part).transpose(0, 1).reshape(rows, self.size * part)


SINGLE = TensorParallel()
