"""Persistent block table: a device tensor with a pinned host mirror written through numpy.

A running request owns one row (its slot) for its whole life. The host
mirror changes only when a request gains blocks, and only the rows that
changed travel, as one non-blocking copy of the span that holds them; or,
in a decode graph step, as (entry, block) pairs in the step's staging buffer,
which the graph writes into the table itself (`take_changes`): no copy of its
own, and a decode opens at most one block per sequence.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.input_batch import ONE
from engine.staging import Fence, WaitClock


class BlockTable:
    def __init__(
        self,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        clock: WaitClock,
        track_rows: bool = False,
    ) -> None:
        self.on_cuda = device.type == "cuda"
        # Follows the last commit's copy: the pinned rows are not rewritten before it ran.
        self.sent = Fence(clock) if self.on_cuda else None
        self.stream = torch.cuda.current_stream(device) if self.on_cuda else None
        shape = (max_num_seqs, max_blocks_per_seq)
        self.cpu = torch.zeros(shape, dtype=torch.int32, pin_memory=self.on_cuda)
        self.width = max_blocks_per_seq
        # On the device, a spare last row: where the decode graph's unused pairs write.
        self.gpu = (
            torch.zeros((max_num_seqs + 1, max_blocks_per_seq), dtype=torch.int32, device=device)
            if self.on_cuda
            else self.cpu
        )
        self.pad = max_num_seqs * max_blocks_per_seq  # flat index of the spare row
        self.flat = self.cpu.numpy().reshape(-1)  # a view: writes land in the pinned buffer
        self.block_size = block_size
        # Positions to blocks and offsets (a power of two); 0-d arrays: see input_batch.ONE.
        self.block_shift = np.array(block_size.bit_length() - 1)
        self.block_mask = np.array(block_size - 1)
        # The same entries as first KV slots (block * block_size), int64 like the slot
        # mapping that adds positions to them: what a step's fill reads.
        self.slot_starts = np.zeros(max_num_seqs * max_blocks_per_seq, dtype=np.int64)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int64)  # valid entries per row
        self.row_start = np.arange(max_num_seqs, dtype=np.int64) * max_blocks_per_seq  # in flat
        self.changed: list[int] = []  # flat indices of the entries written since the last send
        # With tensor parallelism: the span of rows [lo, hi) committed as a copy since
        # the step channel last took it (engine/step_channel.py), for the other ranks.
        self.track_rows = track_rows
        self.rows_sent: tuple[int, int] | None = None

    def update_row(self, slot: int, block_ids: list[int]) -> None:
        """Make row `slot` hold block_ids; writes only the entries it gained."""
        have = self.num_blocks.item(slot)
        if len(block_ids) <= have:
            return
        if self.sent is not None:
            self.sent.wait()
        start, end = slot * self.width + have, slot * self.width + len(block_ids)
        new = np.array(block_ids[have:], dtype=np.int64)
        self.flat[start:end] = new
        self.slot_starts[start:end] = new * self.block_size
        self.changed += range(start, end)
        self.num_blocks[slot] = len(block_ids)

    def append_one(self, slots: np.ndarray, blocks: list[int]) -> None:
        """Row slots[i] gains blocks[i]: the decodes of a step that open a block each."""
        if self.sent is not None:
            self.sent.wait()
        at = self.row_start[slots] + self.num_blocks[slots]
        new = np.array(blocks, dtype=np.int64)
        self.flat[at] = new.astype(np.int32)  # a write that casts costs more
        self.slot_starts[at] = new * self.block_size
        self.num_blocks[slots] += ONE
        self.changed += at.tolist()

    def clear_row(self, slot: int) -> None:
        # Stale entries are harmless: context lengths bound every read.
        self.num_blocks[slot] = 0

    def commit(self) -> None:
        """Send the changed rows to the device (the span of rows that holds them)."""
        changed = self.changed
        if not changed:
            return
        if self.sent is not None or self.track_rows:
            lo, hi = min(changed) // self.width, max(changed) // self.width + 1
            if self.sent is not None:
                self.gpu[lo:hi].copy_(self.cpu[lo:hi], non_blocking=True)
                self.sent.record(self.stream)
            if self.track_rows:
                held = self.rows_sent
                self.rows_sent = (lo, hi) if held is None else (min(lo, held[0]), max(hi, held[1]))
        self.changed = []

    def take_changes(self, limit: int) -> list[int] | None:
        """The flat indices of the entries written since the last send, which the
        caller sends itself (their values are `flat[...]`); None if more than limit."""
        changed = self.changed
        if len(changed) > limit:
            return None
        self.changed = []
        return changed
