"""The prefix cache for models with recurrent layers: their states, saved at block
boundaries beside the KV blocks, so a prompt that starts with a cached prefix starts
from that prefix's state.

A recurrent state is built token by token and cannot be rebuilt from cached KV blocks
(engine/models/layers.py's RecurrentLayer), so a cached prefix is usable only up to a
block boundary where the state was saved. A prompt saves its states at up to two:
- after its last full block before its final token: the most a later lookup of the
  same prompt can take, and where a chat's next turn, which extends it, starts;
- where its cached KV blocks end, when they run past the last saved state: there
  another prompt parted from it, so a third that shares the same prefix (a system
  prompt) finds its state there.
Its prefill chunks are cut to end at them, and the step that reaches one copies the
slot's states into a snapshot row, keyed by the block's chained hash; a new request's
cached prefix is cut back to the last block with a snapshot, which its first step
copies into its slot before the forward. Snapshot rows sit after the slots' rows in
every state tensor and are reused least recently used first (vLLM's "align" mode for
Mamba's prefix caching keeps the same rule: states at block boundaries only).

Copies are planned by the scheduler (restores at admission, saves once a step's
chunk ends at a save point) and run in that step, restores before its forward and
saves after it, in stream order with the steps around them, so a snapshot is
readable by any later step (not the one that writes it: saves are registered after
the step's admissions).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from engine.kv_cache import last_block_key
from engine.request import Request


@dataclass
class StateCopies:
    """A step's state-row copies, rows of every state tensor: `source[i]` into
    `target[i]`, the first `num_restores` before the forward, the rest after it."""

    source: list[int]
    target: list[int]
    num_restores: int

    @property
    def num_saves(self) -> int:
        return len(self.source) - self.num_restores


@dataclass
class _SavePoint:
    position: int  # tokens computed when the state is saved (a multiple of block_size)
    key: bytes  # the chained hash of the block that ends there


class StateSnapshots:
    def __init__(self, first_row: int, num_rows: int, block_size: int) -> None:
        self.block_size = block_size
        self.free_rows = list(range(first_row + num_rows - 1, first_row - 1, -1))
        self.rows: OrderedDict[bytes, int] = OrderedDict()  # key -> row, least recent first
        self.pending: dict[int, list[_SavePoint]] = {}  # slot -> its save points, in order
        self.restores: list[tuple[int, int]] = []  # this step's (row, slot)

    def usable(self, cached: list[int], block_hash: list[bytes | None]) -> list[int]:
        """The cached blocks up to the last one whose states were saved."""
        end = len(cached)
        while end and block_hash[cached[end - 1]] not in self.rows:
            end -= 1
        return cached[:end]

    def save_points(self, req: Request, num_computed: int, num_found: int) -> list[int]:
        """Where req's states are saved (see the module docstring), starting from
        num_computed tokens with num_found tokens' KV blocks in the cache."""
        last = (req.num_tokens - 1) // self.block_size * self.block_size
        return sorted({at for at in (num_found, last) if at > num_computed})

    def admit(self, req: Request, slot: int, cached_key: bytes | None, points: list[int]) -> None:
        """req takes `slot`, from the snapshot under cached_key (its cached prefix's last
        block; None: from zeros), and saves its states at `points`."""
        if cached_key is not None:
            row = self.rows[cached_key]
            self.rows.move_to_end(cached_key)
            self.restores.append((row, slot))
        if points:
            tokens, bs = req.all_token_ids, self.block_size
            self.pending[slot] = [
                _SavePoint(at, last_block_key(req.hash_root, tokens[:at], bs)) for at in points
            ]

    def drop(self, slot: int) -> None:
        """The request in `slot` leaves before its save points (preempted or finished)."""
        self.pending.pop(slot, None)

    def _pending_at(self, slots: np.ndarray) -> list[tuple[int, int]]:
        """(index in slots, slot) of the sequences with save points ahead (a few: those
        prefilling), found in one array op rather than by a walk over the batch."""
        at = np.flatnonzero(np.isin(slots, list(self.pending))).tolist()
        return list(zip(at, slots[at].tolist()))

    def cut(self, slots: np.ndarray, computed: np.ndarray, num_new: np.ndarray) -> bool:
        """Cut the chunks of `slots` that would run past their next save points to end
        there (num_new in place); whether any was cut."""
        cut = False
        for i, slot in self._pending_at(slots):
            room = self.pending[slot][0].position - int(computed[i])
            if 0 < room < num_new[i]:
                num_new[i] = room
                cut = True
        return cut

    def step(self, slots: np.ndarray, ends: np.ndarray) -> StateCopies | None:
        """The step's copies: its restores, and a save for each sequence whose chunk ends
        at its next save point (registered now, so no request admitted this step reads
        it)."""
        restores, self.restores = self.restores, []
        saves: list[tuple[int, int]] = []
        pending = self.pending
        if pending:
            reached = [s for i, s in self._pending_at(slots) if pending[s][0].position == ends[i]]
            for slot in reached:
                key = pending[slot].pop(0).key
                if not pending[slot]:
                    del pending[slot]
                if key in self.rows:  # saved already (the same prompt twice)
                    self.rows.move_to_end(key)
                    continue
                if self.free_rows:
                    row = self.free_rows.pop()
                else:  # the least recently used snapshot goes
                    _, row = self.rows.popitem(last=False)
                self.rows[key] = row
                saves.append((slot, row))
        if not restores and not saves:
            return None
        pairs = restores + saves
        return StateCopies([a for a, _ in pairs], [b for _, b in pairs], len(restores))
