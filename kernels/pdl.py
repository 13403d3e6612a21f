"""Programmatic dependent launch (PDL, Hopper and later) for the decode path's kernels.

A decode step at small batch is a chain of short kernels, and at each boundary the GPU
drains one kernel before the next is launched and ramps up. Launched with PDL, a
kernel's programs may start while the previous kernel's last ones still run. Each kernel
here waits (`gdc_wait`: the previous kernel has completed and its writes are visible),
then lets the next kernel start (`gdc_launch_dependents`). Every program waits, on every
path, so completion is transitive along the chain: when a kernel starts, every kernel
before the previous one has completed. A kernel launched without PDL (cuBLAS) waits for
the one before it as usual. So before waiting, a kernel may read what the previous
kernel does not write: the kernels here read weights there, and the step's metadata
(positions, slots, context lengths, block tables: written before the forward's first
kernel, by copies and non-PDL kernels).

On by default where the GPU has it; `PAGODA_PDL=0` launches every kernel plainly (to
rule PDL out when chasing a wrong result, or to measure what it buys).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.cache
def use_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` are launched with PDL: Hopper and later, unless
    PAGODA_PDL=0 (or Triton's interpreter, which has none)."""
    return (
        device.type == "cuda"
        and os.environ.get("PAGODA_PDL", "1") != "0"
        and os.environ.get("TRITON_INTERPRET", "0") == "0"
        and torch.cuda.get_device_capability(device)[0] >= 9
    )


def launch_options(pdl: bool) -> dict[str, bool]:
    """The launch keyword for a kernel taking PDL (none without: the interpreter has none)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def wait_previous(PDL: tl.constexpr):
    """Wait for the previous kernel's writes, then let the next kernel start."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
