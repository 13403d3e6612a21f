"""The sequences the recurrent layers' walk kernels are tested on."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WalkedSequences:
    """The walk kernels' sequences in their tests: three end to end (7 tokens from a
    state, 5 from zeros, 1 from a state), or the first alone, then a graph's padding:
    two tokens past them and a sequence of none at the spare slot 5. Slots 1, 2 and 5
    belong to no real sequence."""

    starts: torch.Tensor
    lengths: torch.Tensor
    slots: torch.Tensor
    has_state: torch.Tensor
    tokens: int  # rows, padding included
    real: int  # rows of real sequences

    @classmethod
    def of(cls, seqs: int, device: torch.device) -> WalkedSequences:
        lengths = torch.tensor([7, 5, 1][:seqs] + [0], device=device, dtype=torch.int32)
        starts = (torch.cumsum(lengths, 0) - lengths).to(torch.int32)
        slots = torch.tensor([4, 0, 3][:seqs] + [5], device=device)
        has_state = torch.tensor([True, False, True][:seqs] + [False], device=device)
        real = int(lengths.sum())
        return cls(starts, lengths, slots, has_state, real + 2, real)
