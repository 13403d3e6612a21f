"""A split-K projection's output left as its splits' products, for the kernel after it to
sum (kernels/linear.py makes them, kernels/norms.py sums them). Its own module: the norms
and the GEMM import it, and the GEMM's module imports the attention's, which imports the
norms'."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SplitKPartials:
    """A projection's output as its K splits' products, not yet summed: output =
    partials.sum(0) rounded to `dtype`. Each split's product has its scales applied, and
    the first split holds the bias. Only the residual add (`add_norm`) takes one."""

    partials: torch.Tensor  # [splits, M, N] fp32
    dtype: torch.dtype  # the output's

    @property
    def shape(self) -> torch.Size:
        return self.partials.shape[1:]

    @property
    def device(self) -> torch.device:
        return self.partials.device

    def total(self) -> torch.Tensor:  # [M, N]: the output, summed in split order
        out = self.partials[0].clone()
        for part in self.partials[1:]:  # as add_norm sums them (sum(0) fixes no order)
            out += part
        return out.to(self.dtype)


def summed(x: torch.Tensor | SplitKPartials) -> torch.Tensor:
    """x, its splits summed where a projection left them (`dense(..., defer=True)`)."""
    return x.total() if isinstance(x, SplitKPartials) else x
