"""The step's inputs: its metadata written with numpy, straight from the InputBatch's
columns, into a pinned staging buffer (engine/staging.py), and sent with one
non-blocking copy into static device tensors."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.block_table import BlockTable
from engine.config import EngineConfig
from engine.images import apply_mrope
from engine.input_batch import InputBatch
from engine.scheduler import SchedulerOutput
from engine.staging import Fence, SampledTransport, StagedFields, WaitClock


@dataclass
class ModelInput:
    """Device views of the staged buffers for one step."""

    input_gather: torch.Tensor  # [num_tokens] where in StagedFields.words each id is
    positions: torch.Tensor  # [num_tokens]
    slot_mapping: torch.Tensor  # [num_tokens], -1 = padding
    seq_lens: torch.Tensor  # [num_seqs]
    query_start_loc: torch.Tensor  # [num_seqs + 1]
    slot_indices: torch.Tensor  # [num_seqs] block-table row of each sequence
    logits_indices: torch.Tensor  # [num_sampling] last new token's row of each sampling sequence
    max_query_len: int
    is_decode: bool
    per_token: bool  # every token a decode row of its own (AttentionMetadata.per_token)
    prompts_only: bool  # no sequence has context before its new tokens
    lora_ids: torch.Tensor | None  # [num_tokens] each token's LoRA adapter, -1: none
    # Recurrent-state rows copied around the forward (engine/state_snapshots.py): the
    # first state_restores pairs before it, the next state_saves after it.
    state_source: torch.Tensor | None = None
    state_target: torch.Tensor | None = None
    state_restores: int = 0
    state_saves: int = 0


class StepInputs:
    """ModelRunner's half that writes and sends a step's inputs (its execute and the CUDA
    graphs call it)."""

    def __init__(
        self,
        config: EngineConfig,
        batch: InputBatch | None,
        block_table: BlockTable,
        clock: WaitClock,
    ) -> None:
        self.batch, self.block_table = batch, block_table
        device, seqs = config.torch_device, config.max_num_seqs
        max_tokens = max(config.max_num_batched_tokens, seqs)
        i64, i32 = torch.int64, torch.int32
        on_cuda = device.type == "cuda"
        # Block-table entries a step's graph writes itself: a decode opens at most one
        # block per sequence, and a step with prompts about one per block_size new
        # tokens more (prefix-cache hits, beyond that, go as a copy of their rows).
        self.table_capacity = seqs + max_tokens // config.block_size
        # On CUDA every host buffer comes twice, used by alternate steps: a step is
        # written while the last one's copies may still be queued, and the ids of one
        # are read while the next one's are on their way.
        self.num_buffers = 2 if on_cuda else 1
        # Input ids are gathered on the device from the host's ids and the last step's
        # sampled ids (device-only), so a decode never waits for the host to read them.
        tokens_fields = ("input_ids", "input_gather", "positions", "slot_mapping")
        # Speculative verify steps have a logits row per token, and their tokens attend
        # as sequences of their own.
        rows = max_tokens if config.num_speculative_tokens else seqs
        self.lora = config.lora is not None
        if self.lora:
            tokens_fields += ("lora_ids",)
        self.staged = StagedFields(
            {
                **dict.fromkeys(tokens_fields, (max_tokens, i64)),
                "slot_indices": (rows, i64),
                "logits_indices": (rows, i64),
                "seq_lens": (rows, i32),
                "query_start_loc": (rows + 1, i32),
                # Block-table entries a graph writes (BlockTable.take_changes).
                "table_index": (self.table_capacity, i64),
                "table_value": (self.table_capacity, i32),
                # A step's state copies: up to a restore and a save per sequence.
                **(
                    dict.fromkeys(("state_source", "state_target"), (2 * seqs, i64))
                    if config.state_snapshots
                    else {}
                ),
            },
            device,
            device_only={"sampled_ids": (seqs, i64)},
            copies=self.num_buffers,
        )
        for views in self.staged.nps:  # unused pairs write the table's spare row
            views["table_index"][:] = self.block_table.pad
        self.table_pairs = [0] * self.num_buffers  # pairs in use in each host buffer
        self.ids_offset = self.staged.offset["input_ids"]
        # Where in StagedFields.words each row of the sampled ids sits.
        self.sampled_words = self.staged.offset["sampled_ids"] + np.arange(seqs, dtype=np.int64)
        self.parity = 0  # which of the host buffers this step uses
        self.buf = self.staged.np  # numpy views to write through, by field name
        # By host buffer: the InputBatch layout of the steady decode (see fill) that
        # wrote its slot indices, query starts, logits rows and input gather last
        # (None: another step, or none yet).
        self.steady_layout: list[int | None] = [None] * self.num_buffers
        self.arange = np.arange(max_tokens + 1, dtype=np.int64)
        # A pinned buffer is rewritten only once the last copy out of it has run: each
        # staging buffer's fence follows its last copy (a send, or the decode graph
        # that copies it in).
        self.staged_sent = [Fence(clock) for _ in range(self.num_buffers)] if on_cuda else []
        # Recording on a stream object kept here skips building one per call.
        self.stream = torch.cuda.current_stream(device) if on_cuda else None
        self.sampled = SampledTransport(self.staged.gpu["sampled_ids"], device, clock)
        # By slot: where its last sampled token is in StagedFields.words.
        self.sampled_at = np.zeros(seqs, dtype=np.int64)
        # The InputBatch layout whose decode (all its rows, in order) last set
        # sampled_at: row i of the batch at sampled row i. None: another step.
        self.sampled_layout: int | None = None
        # Verify steps up to this many tokens attend per token (AttentionMetadata.per_token;
        # the CUDA graphs lower it to their largest verify bucket), and whether this one does.
        self.max_per_token_rows = max_tokens
        self.per_token = False
        self.prompts_only = False  # this step's (AttentionMetadata.prompts_only)

    def fill(self, out: SchedulerOutput) -> int:
        """Write the step's metadata into the pinned buffers; returns max_query_len.

        Token i of sequence b sits at position starts[b] + (i - query_start[b]); its id
        is in the InputBatch's token table if the host knows it, else it was sampled
        last step and is still on the device, at its slot's row of the sampled ids."""
        self.next_buffers()
        buf, arange, table = self.buf, self.arange, self.block_table
        n, num_tokens = out.num_seqs, out.num_tokens
        slots, starts, num_new = out.slots, out.starts, out.num_new_tokens
        qsl, gather, parity = buf["query_start_loc"], buf["input_gather"][:num_tokens], self.parity
        if out.is_decode_only:  # one token each: most of it is an arange
            positions = buf["positions"][:n]
            positions[:] = starts
            token_slots, known = slots, out.num_known
            on_device = positions >= known
            all_on_device = np.count_nonzero(on_device) == n
            # Steady: all the rows of last step's layout again, each input the id it
            # sampled then (row i's, sampled row i), still on the device.
            layout = out.layout
            steady = all_on_device and layout is not None and layout == self.sampled_layout
            if not steady or self.steady_layout[parity] != layout:  # else in place already
                qsl[: n + 1] = arange[: n + 1]
                buf["logits_indices"][:n] = arange[:n]
                buf["slot_indices"][:n] = slots
                if self.lora:  # a row's adapter is its request's, as long as the layout
                    buf["lora_ids"][:n] = self.batch.lora[slots]
                if steady:
                    gather[:] = self.sampled_words[:n]
                self.steady_layout[parity] = layout if steady else None
            max_query_len = 1
            self.prompts_only = False
        else:
            self.prompts_only = not bool(starts.any())
            self.steady_layout[parity] = None
            steady = False
            buf["slot_indices"][:n] = slots
            qsl[0] = 0
            np.cumsum(num_new, out=qsl[1 : n + 1])
            positions = buf["positions"][:num_tokens]
            np.add(np.repeat(starts - qsl[:n], num_new), arange[:num_tokens], out=positions)
            token_slots = np.repeat(slots, num_new)
            if self.lora:
                buf["lora_ids"][:num_tokens] = self.batch.lora[token_slots]
            known = np.repeat(out.num_known, num_new)
            on_device = positions >= known
            all_on_device = np.count_nonzero(on_device) == num_tokens
            last = qsl[1 : n + 1] - 1  # each sequence's last new token
            sampling_last = last[out.samples]
            if out.num_drafts is None:
                buf["logits_indices"][: len(sampling_last)] = sampling_last
            else:  # a sequence's drafts are its last tokens: a row for each, and the last
                drafts = out.num_drafts[out.samples]
                rows = drafts + 1
                first = np.repeat(sampling_last - drafts - (np.cumsum(rows) - rows), rows)
                np.add(first, arange[: out.num_logits], out=buf["logits_indices"][: out.num_logits])
            max_query_len = int(num_new.max())
        buf["seq_lens"][:n] = out.seq_lens
        self.per_token = out.verifies_only and num_tokens <= self.max_per_token_rows
        if self.per_token:  # each token a sequence: its context ends at itself
            buf["slot_indices"][:num_tokens] = token_slots
            buf["seq_lens"][:num_tokens] = positions + 1
            qsl[: num_tokens + 1] = arange[: num_tokens + 1]
            max_query_len = 1
        # slot = block * block_size + offset, read off the block table's host mirror.
        entries = positions >> table.block_shift
        entries += table.row_start[token_slots]
        np.add(
            table.slot_starts[entries],
            positions & table.block_mask,
            out=buf["slot_mapping"][:num_tokens],
        )
        if not all_on_device:
            on_host = ~on_device
            ids = buf["input_ids"][:num_tokens]
            ids[on_host] = self.batch.token_ids[token_slots[on_host], positions[on_host]]
            np.add(arange[:num_tokens], self.ids_offset, out=gather)
            gather[on_device] = self.sampled_at[token_slots[on_device]]
        elif not steady:  # a decode's usual case: sampled last step
            gather[:] = self.sampled_at[token_slots]
        if self.batch is not None and self.batch.num_mrope:  # indices so far: now rotary
            apply_mrope(self.batch, token_slots, positions)
        # The ids this step samples land in the sampled-ids buffer in sampling order
        # (a steady decode's: where they did last step).
        if not steady:
            sampling = out.sampling_slots
            self.sampled_at[sampling] = self.sampled_words[: len(sampling)]
            self.sampled_layout = out.layout if out.is_decode_only else None
        return max_query_len

    def decode_ranges(self, bucket: int) -> list[tuple[int, int]]:
        """The staged words a decode graph of `bucket` sequences reads: every field's
        first `bucket` entries (one more query start), no state copies (run eagerly)."""
        lengths = dict.fromkeys(self.staged.np, bucket)
        lengths["query_start_loc"] = bucket + 1
        for name in ("state_source", "state_target"):
            lengths.pop(name, None)
        return self.staged.word_ranges(lengths)

    def next_buffers(self) -> None:
        """Move to the other host buffers (the step's), once the last copy out of its
        staging buffer has run (two steps back: done long ago, as a rule)."""
        self.parity = (self.parity + 1) % self.num_buffers
        self.buf = self.staged.nps[self.parity]
        if self.staged_sent:
            self.staged_sent[self.parity].wait()

    def send(self, *sizes: int) -> ModelInput:
        """The step's copies, and device views of what they fill (`inputs(*sizes)`)."""
        self.copy_staged()
        return self.inputs(*sizes)

    def inputs(
        self,
        num_tokens: int,
        num_seqs: int,
        max_query_len: int,
        is_decode: bool,
        num_sampling: int | None = None,  # None: every sequence samples
        per_token: bool = False,  # num_seqs is then num_tokens
        prompts_only: bool = False,
        state_restores: int = 0,
        state_saves: int = 0,
    ) -> ModelInput:
        gpu = self.staged.gpu
        copies = state_restores + state_saves
        return ModelInput(
            input_gather=gpu["input_gather"][:num_tokens],
            positions=gpu["positions"][:num_tokens],
            slot_mapping=gpu["slot_mapping"][:num_tokens],
            seq_lens=gpu["seq_lens"][:num_seqs],
            query_start_loc=gpu["query_start_loc"][: num_seqs + 1],
            slot_indices=gpu["slot_indices"][:num_seqs],
            logits_indices=gpu["logits_indices"][
                : num_seqs if num_sampling is None else num_sampling
            ],
            max_query_len=max_query_len,
            is_decode=is_decode,
            per_token=per_token,
            prompts_only=prompts_only,
            lora_ids=gpu["lora_ids"][:num_tokens] if self.lora else None,
            state_source=gpu["state_source"][:copies] if copies else None,
            state_target=gpu["state_target"][:copies] if copies else None,
            state_restores=state_restores,
            state_saves=state_saves,
        )

    def copy_staged(self) -> None:
        """One non-blocking copy of the staged fields into the static device tensors,
        plus the block-table rows that changed."""
        self.block_table.commit()
        self.staged.send(self.parity)
        if self.staged_sent:
            self.staged_sent[self.parity].record(self.stream)

    def stage_table_changes(self, capacity: int) -> None:
        """Put the block-table entries written since the last send into the staging
        buffer, as (flat index, block) pairs the step's graph writes (up to
        `capacity` of them; if there are more, the rows are copied instead): a copy
        of the rows is a driver call of its own."""
        table = self.block_table
        changed = table.take_changes(capacity)
        if changed is None:
            table.commit()
            changed = []
        k, held = len(changed), self.table_pairs[self.parity]
        if k:
            self.buf["table_index"][:k] = changed
            self.buf["table_value"][:k] = table.flat[changed]
        if held > k:
            self.buf["table_index"][k:held] = table.pad
        self.table_pairs[self.parity] = k
