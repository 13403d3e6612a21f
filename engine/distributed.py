"""Tensor parallelism's process group as the model layers see it.

One `TensorParallel` per process: its rank, the group's size and the
`torch.distributed` process group (NCCL on CUDA, gloo on CPU). The layers shard
their weights by `rank` and reduce through `all_reduce`; with size 1 every
collective is the identity and no process group exists, so a single GPU pays
nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

    from engine.one_shot import OneShotAllReduce


class WorkerFailed(RuntimeError):
    """A tensor-parallel rank died or failed to start, or a step failed (the ranks may
    no longer agree on which collectives ran): the engine cannot go on. Here, not with
    the group's code: the API processes catch it and never import torch."""


class CollectiveGate:
    """This process's collective calls and an abort of its communicators, one at a time.

    The watchdog thread aborts the communicators when a rank dies, so that device work
    waiting on it ends; torch's process-group state is not safe to tear down while the
    engine thread is inside a call on it. Calls hold the gate; the abort takes it (or
    goes ahead after `wait_s`: a call blocked on the dead rank can only end by the
    abort), and every later call raises WorkerFailed without touching the group."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.closed: str | None = None  # why, once aborted

    def open(self) -> None:
        self.closed = None

    @contextmanager
    def call(self) -> Iterator[None]:
        with self._lock:
            if self.closed is not None:
                raise WorkerFailed(self.closed)
            yield

    def abort(self, why: str, abort: Callable[[], None], wait_s: float = 2.0) -> None:
        held = self._lock.acquire(timeout=wait_s)
        try:
            self.closed = why
            abort()
        finally:
            if held:
                self._lock.release()


GATE = CollectiveGate()


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: ProcessGroup | None = None  # None when size == 1
    # Small tensors' sums over peer memory (engine/one_shot.py); None: NCCL (or gloo) only.
    one_shot: OneShotAllReduce | None = None

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
        """x summed over the ranks: in place, or for a small tensor in a new one."""
        if self.size > 1:
            import torch.distributed as dist

            with GATE.call():
                if self.one_shot is not None and self.one_shot.fits(x):
                    return self.one_shot(x)
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
        with GATE.call():
            gather(out, x.contiguous(), group=self.group)  # [size * rows, part], rank-major
        return out.view(self.size, rows, part).transpose(0, 1).reshape(rows, self.size * part)


SINGLE = TensorParallel()
