"""What tests inspect of the process itself: the collector's frozen heap, the aten ops run."""

from __future__ import annotations

import gc

from torch.utils._python_dispatch import TorchDispatchMode


def is_frozen(obj) -> bool:
    """Tracked by the collector but in none of its generations: frozen."""
    return gc.is_tracked(obj) and all(o is not obj for o in gc.get_objects())


class OpLog(TorchDispatchMode):
    """The aten ops run inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))
