"""Tensors in, logits out: step inputs, the KV cache, and CUDA-graph decode.

Per-step metadata is written with numpy into one pinned host buffer and
sent with one non-blocking copy into static device tensors. Input ids
are gathered on the device, from the host's ids or from the previous step's
sampled ids, which never have to visit the host first. Decode-only
steps replay a CUDA graph captured for the next bucket up in batch size;
padded entries have context length 0 and slot -1, so they read and write
nothing. The graph also takes every row's argmax into the device buffer the next
step's inputs are gathered from: an all-greedy batch (the common case) then
launches nothing after the replay but the ids' copy to the host. Steps with
prefill tokens replay a whole-forward graph too, captured per token bucket up
to 2048 tokens for max_num_seqs sequences: the prefill attention's grid depends
on those two counts only (kernels.prefill_attention), so padded tokens (slot -1)
and empty padded sequences make any such step fit. Larger steps, and everything
under --enforce-eager, run eagerly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from engine.block_table import BlockTable
from engine.config import EngineConfig
from engine.models.layers import AttentionMetadata, AttentionOps, PagedAttention
from engine.scheduler import SchedulerOutput

CPU_KV_CACHE_BYTES = 1 << 30  # the CPU has no free-memory figure worth trusting


STEP_PATHS = ("graph", "prefill graph", "eager")


class StagedFields:
    """Named integer arrays (int64 or int32) packed in one pinned host buffer, with numpy
    views for writing, and their device twin (the same tensor on CPU): a step's
    metadata travels in one copy, whatever the fields' dtypes.

    Offsets never change, so a CUDA graph captured on the device views sees every
    later step's values. `device_only` fields follow the staged ones on the device
    and are never overwritten by a send (on CPU they are simply more of the buffer).
    On CUDA there are `copies` host buffers (`np[i]` writes buffer i, `send(i)` sends
    it), so a step can be written while the last one's copy is still queued."""

    ALIGN = 16  # bytes: every field starts where any integer view of it may start

    def __init__(
        self,
        fields: dict[str, tuple[int, torch.dtype]],  # name -> (size, dtype)
        device: torch.device,
        device_only: dict[str, tuple[int, torch.dtype]] | None = None,
        copies: int = 1,
    ) -> None:
        on_cuda = device.type == "cuda"
        layout: dict[str, tuple[int, int, torch.dtype]] = {}  # name -> (byte offset, size, dtype)
        offset = staged = 0
        for name, (size, dtype) in {**fields, **(device_only or {})}.items():
            layout[name] = (offset, size, dtype)
            offset += -(-size * dtype.itemsize // self.ALIGN) * self.ALIGN
            if name in fields:
                staged = offset
        self.hosts = [
            torch.zeros(staged if on_cuda else offset, dtype=torch.uint8, pin_memory=on_cuda)
            for _ in range(copies if on_cuda else 1)
        ]
        self.host = self.hosts[0]
        self.device = (
            torch.zeros(offset, dtype=torch.uint8, device=device) if on_cuda else self.host
        )
        # The whole buffer as int64: int64 fields are addressed by `offset` in it.
        self.words = self.device.view(torch.int64)
        self.nps: list[dict[str, np.ndarray]] = [{} for _ in self.hosts]
        self.gpu: dict[str, torch.Tensor] = {}
        self.offset: dict[str, int] = {}  # in elements of the field's dtype
        for name, (start, size, dtype) in layout.items():
            end = start + size * dtype.itemsize
            if name in fields:
                np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
                for host, views in zip(self.hosts, self.nps):
                    views[name] = host.numpy()[start:end].view(np_dtype)
            self.gpu[name] = self.device[start:end].view(dtype)
            self.offset[name] = start // dtype.itemsize
        self.np = self.nps[0]
        self.staged = self.device[:staged]

    def send(self, copy: int = 0) -> None:
        if self.device is not self.host:
            self.staged.copy_(self.hosts[copy], non_blocking=True)


class Fence:
    """A CUDA event that remembers being seen complete since it was last recorded,
    so that waiting on it again costs nothing (a query is a driver call, ~2 us)."""

    def __init__(self) -> None:
        self.event = torch.cuda.Event()
        self.pending = False

    def record(self, stream: torch.cuda.Stream) -> None:
        self.event.record(stream)
        self.pending = True


class SampledIds:
    """A step's sampled ids on their way to the host; tolist() and numpy() wait for them."""

    def __init__(
        self,
        host: torch.Tensor,
        done: Fence | None,
        runner: ModelRunner,
        array: np.ndarray | None = None,  # host's numpy view, if made already
    ):
        self.host, self.done, self.runner, self.array = host, done, runner, array

    def tolist(self) -> list[int]:
        if self.done is not None:
            self.runner.wait(self.done)
        return self.host.tolist()

    def numpy(self) -> np.ndarray:
        """A view of the ids (the buffer is reused two steps on: copy what is kept)."""
        if self.done is not None:
            self.runner.wait(self.done)
        return self.host.numpy() if self.array is None else self.array


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


class ModelRunner:
    def __init__(self, config: EngineConfig, model: nn.Module, hf_config) -> None:
        self.config = config
        self.model = model
        self.device = config.torch_device
        self.dtype = next(model.parameters()).dtype
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_blocks_per_seq = config.max_blocks_per_seq(config.max_model_len)

        self.attn_layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
        self.num_blocks = self._num_kv_blocks()
        self._allocate_kv_cache()

        self.block_table = BlockTable(self.max_num_seqs, self.max_blocks_per_seq, self.device)
        max_tokens = max(config.max_num_batched_tokens, self.max_num_seqs)
        seqs = self.max_num_seqs
        tokens_fields = ("input_ids", "input_gather", "positions", "slot_mapping")
        i64, i32 = torch.int64, torch.int32
        on_cuda = self.device.type == "cuda"
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
        self.staged = StagedFields(
            {
                **dict.fromkeys(tokens_fields, (max_tokens, i64)),
                "slot_indices": (seqs, i64),
                "logits_indices": (seqs, i64),
                "seq_lens": (seqs, i32),
                "query_start_loc": (seqs + 1, i32),
                # Block-table entries a graph writes (BlockTable.take_changes).
                "table_index": (self.table_capacity, i64),
                "table_value": (self.table_capacity, i32),
            },
            self.device,
            device_only={"sampled_ids": (seqs, i64)},
            copies=self.num_buffers,
        )
        for views in self.staged.nps:  # unused pairs write the table's spare row
            views["table_index"][:] = self.block_table.pad
        self.table_pairs = [0] * self.num_buffers  # pairs in use in each host buffer
        self.ids_offset = self.staged.offset["input_ids"]
        self.sampled_offset = self.staged.offset["sampled_ids"]
        self.parity = 0  # which of the host buffers this step uses
        self.buf = self.staged.np  # numpy views to write through, by field name
        self.arange = np.arange(max_tokens + 1, dtype=np.int64)
        self.sampled_gather = self.arange[: seqs + 1] + self.sampled_offset  # row i's last id
        # A pinned buffer is rewritten only once the last copy out of it has run: each
        # staging buffer's event follows its last copy (a send, or the decode graph
        # that copies it in), the block table's its last commit.
        self.staged_sent = [Fence() for _ in range(self.num_buffers)] if on_cuda else []
        self.table_sent = Fence() if on_cuda else None
        # Recording on a stream object kept here skips building one per call (~5 us).
        self.stream = torch.cuda.current_stream(self.device) if on_cuda else None
        # Sampled ids come back through the step's pinned buffer (the decode graph
        # copies its argmax there itself); done[i] follows the copy into buffer i.
        self.sampled_host = (
            [torch.zeros(seqs, dtype=torch.int64, pin_memory=True) for _ in range(2)]
            if on_cuda
            else []
        )
        self.sampled_done = [Fence() for _ in range(2)] if on_cuda else []
        # Views by row count, made once: slicing a tensor costs ~2 us of host time, and
        # the decode step would slice four every step.
        self.sampled_rows = [self.staged.gpu["sampled_ids"][:k] for k in range(seqs + 1)]
        self.sampled_host_rows = [[host[:k] for k in range(seqs + 1)] for host in self.sampled_host]
        self.sampled_host_np = [host.numpy() for host in self.sampled_host]
        self.argmax: torch.Tensor | None = None  # a graph's greedy ids: see execute()
        self.argmax_on_host = False
        self.sampled_for: list = []  # the requests whose rows the last step samples, in order
        # By block-table slot: the row of the request's last sampled token in that step's
        # ids (an array, so that a step reads and writes every row with one numpy call).
        self.slot_rows = np.zeros(seqs, dtype=np.int64)
        # The batch the last decode fill of each buffer wrote (None after any other
        # write): when the next is the same list, its slots and row layout are there.
        self.decode_filled: list[list | None] = [None] * self.num_buffers
        # The last decode step's slot mapping and its batch: in the steady state every
        # slot is one on, but for a sequence that opens a block (no table lookups).
        self.last_slots = np.zeros(seqs, dtype=np.int64)
        self.last_slots_for: list | None = None
        self.wait_s = 0.0  # time the host spent blocked on the device (for profiling)
        # Host work that can wait, done when the host would otherwise block on the
        # device (the engine's deferred block hashing).
        self.idle_work: Callable[[], None] | None = None
        # Steps by how they ran: a decode CUDA graph, a prefill graph (a step with
        # prefill tokens), or eagerly. Read by the server's periodic stats line.
        self.steps_by_path = dict.fromkeys(STEP_PATHS, 0)

        # Decode graphs by bucket: one per staging buffer, each copying it in.
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.graph_logits: dict[int, list[torch.Tensor]] = {}
        self.decode_bucket = config.cuda_graph_bucket_table()
        # By buffer, then batch size: the logits rows of its bucket's graph.
        self.graph_logit_rows: list[list[torch.Tensor | None]] = []
        if config.use_cuda_graphs:
            self._capture_decode_graphs()
            self.graph_logit_rows = [
                [
                    self.graph_logits[self.decode_bucket[n]][i][:n] if n else None
                    for n in range(seqs + 1)
                ]
                for i in range(self.num_buffers)
            ]
        # Steps with prefill tokens: (graph, its logits [max_num_seqs, vocab]) by token
        # bucket, and the bucket of each token count they cover.
        self.prefill_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.prefill_bucket: list[int] = []
        if config.use_prefill_graphs:
            self._capture_prefill_graphs()

    # -- KV cache ---------------------------------------------------------

    def _bytes_per_block(self) -> int:
        layer = self.attn_layers[0]
        per_token = 2 * layer.num_kv_heads * layer.head_dim * self.dtype.itemsize
        return per_token * self.block_size * len(self.attn_layers)

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * self.config.gpu_memory_utilization - (total - free)
            budget -= self._activation_reserve()
        else:
            budget = CPU_KV_CACHE_BYTES
        useful = self.max_num_seqs * self.max_blocks_per_seq  # more could never be used
        num_blocks = min(int(budget // self._bytes_per_block()), useful)
        if num_blocks < self.max_blocks_per_seq:
            raise ValueError(
                f"only {num_blocks} KV blocks fit in memory, fewer than one max_model_len sequence "
                f"needs ({self.max_blocks_per_seq}); lower max_model_len or raise gpu_memory_utilization"
            )
        return num_blocks

    def _activation_reserve(self) -> int:
        """Bytes kept free for activations, logits and graph pools (a generous estimate)."""
        hf = self.model.config
        hidden = getattr(hf, "hidden_size", None) or hf.n_embd
        inner = getattr(hf, "intermediate_size", None) or 4 * hidden
        tokens = self.config.max_num_batched_tokens
        activations = tokens * (4 * hidden + 3 * inner) * self.dtype.itemsize
        logits = self.max_num_seqs * hf.vocab_size * 4 * 4  # fp32 logits and sampler temporaries
        return int(2 * (activations + logits)) + (512 << 20)

    def _allocate_kv_cache(self) -> None:
        layer = self.attn_layers[0]
        shape = (self.num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
        ops = AttentionOps.for_device(self.device)
        for layer in self.attn_layers:
            layer.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.ops = ops

    # -- inputs -----------------------------------------------------------

    def _fill(self, batch: SchedulerOutput, on_device: bool = False) -> tuple[int, int]:
        """Write the step's metadata into the pinned buffers; returns (num_tokens, max_query_len).

        on_device: every input id is the last step's sampled id, still on the device."""
        self._next_buffers()
        requests = batch.requests
        num_seqs = len(requests)
        table = self.block_table
        if batch.grown and self.table_sent is not None:
            self.wait(self.table_sent)  # the last commit has read the rows
        if batch.steady:  # each grown row gains one entry: the block it opened
            if batch.grown:
                table.append_entries([requests[i].slot for i in batch.grown], batch.opened)
        else:
            for i in batch.grown:
                req = requests[i]
                if i >= batch.first_admitted:
                    table.clear_row(req.slot)
                table.update_row(req.slot, req.block_ids)

        if batch.is_decode_only:
            self._fill_decode(batch, on_device)
            return num_seqs, 1

        self.decode_filled[self.parity] = None
        self.last_slots_for = None
        num_new = np.array(batch.num_new_tokens, dtype=np.int64)
        num_computed = np.array(batch.starts, dtype=np.int64)
        slots = np.array([req.slot for req in requests], dtype=np.int64)
        num_tokens = int(num_new.sum())

        qsl = self.buf["query_start_loc"]
        qsl[0] = 0
        qsl[1 : num_seqs + 1] = np.cumsum(num_new)
        self.buf["seq_lens"][:num_seqs] = num_computed + num_new
        self.buf["slot_indices"][:num_seqs] = slots
        # Logits rows of the sequences that sample, in batch order (not the prefill
        # chunks that stop short of their prompt's end).
        last = qsl[1 : num_seqs + 1] - 1
        if batch.chunked:
            last = np.delete(last, batch.chunked)
        self.buf["logits_indices"][: len(last)] = last

        # Token i of sequence b sits at position num_computed[b] + (i - qsl[b]).
        positions = self.buf["positions"][:num_tokens]
        np.add(
            np.repeat(num_computed - qsl[:num_seqs], num_new), np.arange(num_tokens), out=positions
        )
        self._slot_mapping(np.repeat(slots, num_new), positions, num_tokens)

        # Most rows of a step with prefill are decodes whose one input is still on the
        # device: only the rows with ids on the host are visited one by one.
        ids, gather = self.buf["input_ids"], self.buf["input_gather"]
        gather[:num_tokens] = self.ids_offset + self.arange[:num_tokens]
        ends = num_computed + num_new
        known = np.minimum(ends, [len(req.all_token_ids) for req in requests])
        for i in np.flatnonzero(known > num_computed).tolist():
            start, pos = batch.starts[i], int(qsl[i])
            ids[pos : pos + int(known[i]) - start] = requests[i].all_token_ids[start : known[i]]
        # A row's last token sampled last step and not read yet: gathered from its row there.
        waiting = np.flatnonzero(known < ends)
        if len(waiting):
            gather[qsl[waiting + 1] - 1] = self.slot_rows[slots[waiting]] + self.sampled_offset
        sampling_slots = np.delete(slots, batch.chunked) if batch.chunked else slots
        self._assign_sample_rows(batch.sampling(), sampling_slots)
        return num_tokens, int(num_new.max())

    def _fill_decode(self, batch: SchedulerOutput, on_device: bool) -> None:
        """The hot path: one new token per sequence, so most metadata is an arange.

        The same batch as last step (the steady state: the scheduler hands over the same
        list) has its slots, query starts and logits rows in place already."""
        reqs = batch.requests
        n = len(reqs)
        buf = self.buf
        positions = buf["positions"][:n]
        positions[:] = batch.starts
        slots = buf["slot_indices"][:n]
        gather = buf["input_gather"][:n]
        if reqs is not self.decode_filled[self.parity]:  # else its slots and rows are there
            slots[:] = [req.slot for req in reqs]
            buf["query_start_loc"][: n + 1] = self.arange[: n + 1]
            buf["logits_indices"][:n] = self.arange[:n]
            self.decode_filled[self.parity] = reqs
        if reqs is self.sampled_for or reqs == self.sampled_for:  # row i sampled sequence i
            gather[:] = self.sampled_gather[:n]
        else:
            np.add(self.slot_rows[slots], self.sampled_offset, out=gather)
            self._assign_sample_rows(reqs, slots)
        # Usually every input is last step's sampled id, still on the device; one the
        # host has read already (num_inflight 0) is taken from the host's ids.
        if not on_device:
            for i in [i for i, req in enumerate(reqs) if not req.num_inflight]:
                buf["input_ids"][i] = reqs[i].all_token_ids[batch.starts[i]]
                gather[i] = self.ids_offset + i
        buf["seq_lens"][:n] = positions + 1  # an int32 field: a cast in place is slower
        last = self.last_slots[:n]
        if batch.steady and reqs is self.last_slots_for:
            last += 1
            for i, block in zip(batch.grown, batch.opened):  # the opened block's first slot
                last[i] = block * self.block_size
            buf["slot_mapping"][:n] = last
        else:
            self._slot_mapping(slots, positions, n)
            last[:] = buf["slot_mapping"][:n]
            self.last_slots_for = reqs

    def _next_buffers(self) -> None:
        """Move to the other host buffers (the step's), once the last copy out of its
        staging buffer has run (two steps back: done long ago, as a rule)."""
        self.parity = (self.parity + 1) % self.num_buffers
        self.buf = self.staged.nps[self.parity]
        if self.staged_sent:
            self.wait(self.staged_sent[self.parity])

    def _assign_sample_rows(self, reqs: list, slots: np.ndarray) -> None:
        """The engine samples the sampling requests (in `slots`) in batch order: row k
        is the k-th."""
        self.slot_rows[slots] = self.arange[: len(slots)]
        self.sampled_for = reqs

    def _slot_mapping(self, seq_slots: np.ndarray, positions: np.ndarray, num_tokens: int) -> None:
        """slot = block * block_size + offset, read off the block table's host mirror."""
        blocks = self.block_table.np[seq_slots, positions // self.block_size]
        np.add(
            blocks * self.block_size,
            positions % self.block_size,
            out=self.buf["slot_mapping"][:num_tokens],
        )

    def _send(
        self,
        num_tokens: int,
        num_seqs: int,
        max_query_len: int,
        is_decode: bool,
        num_sampling: int | None = None,  # None: every sequence samples
    ) -> ModelInput:
        """The step's copies, and device views of what they fill."""
        self._copy()
        gpu = self.staged.gpu
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
        )

    def _copy(self) -> None:
        """One non-blocking copy of the staged fields into the static device tensors,
        plus the block-table rows that changed."""
        self._commit_table()
        self.staged.send(self.parity)
        if self.staged_sent:
            self.staged_sent[self.parity].record(self.stream)

    def _commit_table(self) -> None:
        if self.block_table.commit() and self.table_sent is not None:
            self.table_sent.record(self.stream)

    def _stage_table_changes(self, bucket: int) -> None:
        """Put the block-table entries written since the last send into the staging
        buffer, as (flat index, block) pairs the step's graph writes (the first
        `bucket` of them; if there are more, the rows are copied). A copy of the
        rows is a driver call of its own, and it measured ~90 us of host time on
        the H100 host in steps with prompts."""
        table = self.block_table
        changed = table.take_changes(bucket)
        if changed is None:
            self._commit_table()
            changed = []
        k, held = len(changed), self.table_pairs[self.parity]
        if k:
            self.buf["table_index"][:k] = changed
            self.buf["table_value"][:k] = table.flat[changed]
        if held > k:
            self.buf["table_index"][k:held] = table.pad
        self.table_pairs[self.parity] = k

    # -- forward ----------------------------------------------------------

    def execute(self, batch: SchedulerOutput, on_device: bool = False) -> torch.Tensor:
        """Logits [num_sampling, vocab] at the last new token of each sequence that
        samples (batch.sampling(): every one but the prefill chunks that stop short).

        After a graph, `argmax` holds their argmax ids on the device (None after an
        eager step); `argmax_on_host` says whether the graph copied them to the host
        too (a decode graph does). on_device: see _fill. A graph replay runs no torch
        op, so only the other paths enter inference mode (~3 us a call)."""
        num_seqs = len(batch.requests)
        num_tokens, max_query_len = self._fill(batch, on_device)
        self.argmax = None
        self.argmax_on_host = False
        if batch.is_decode_only and self.graphs and num_seqs <= self.max_num_seqs:
            bucket = self.decode_bucket[num_seqs]
            if bucket > num_seqs:
                self._pad_decode(num_seqs, bucket)
            self._stage_table_changes(bucket)
            # The graph copies the step's staging buffer in (and writes the block-table
            # entries it carries), and the argmax out.
            self.graphs[bucket][self.parity].replay()
            self.staged_sent[self.parity].record(self.stream)
            self.steps_by_path["graph"] += 1
            self.argmax = self.sampled_rows[num_seqs]
            self.argmax_on_host = True
            return self.graph_logit_rows[self.parity][num_seqs]
        with torch.inference_mode():
            return self._run_ungraphed(batch, num_tokens, max_query_len)

    def _run_ungraphed(self, batch: SchedulerOutput, num_tokens: int, max_query_len: int):
        num_seqs = len(batch.requests)
        num_sampling = num_seqs - len(batch.chunked)
        if num_tokens < len(self.prefill_bucket):  # prefill tokens (decodes took a graph)
            bucket = self.prefill_bucket[num_tokens]
            self._pad_tokens(num_tokens, bucket)
            self._pad_seqs(num_seqs, num_tokens, num_sampling)
            self._stage_table_changes(self.table_capacity)
            self._copy()
            graph, logits = self.prefill_graphs[bucket]
            graph.replay()
            self.steps_by_path["prefill graph"] += 1
            self.argmax = self.sampled_rows[num_sampling]
            return logits[:num_sampling]
        is_decode = batch.is_decode_only
        inp = self._send(num_tokens, num_seqs, max_query_len, is_decode, num_sampling)
        self.steps_by_path["eager"] += 1
        return self._forward(inp)

    def _meta(self, inp: ModelInput) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=inp.slot_mapping,
            # Gathered here so that a captured graph gathers on every replay.
            block_table=self.block_table.gpu[inp.slot_indices],  # [num_seqs, max_blocks_per_seq]
            seq_lens=inp.seq_lens,
            query_start_loc=inp.query_start_loc,
            max_query_len=inp.max_query_len,
            is_decode=inp.is_decode,
        )

    def _hidden(self, inp: ModelInput, meta: AttentionMetadata) -> torch.Tensor:
        input_ids = self.staged.words[inp.input_gather]  # in the graph: gathered every replay
        return self.model(input_ids, inp.positions, meta)

    def _forward(self, inp: ModelInput) -> torch.Tensor:
        hidden = self._hidden(inp, self._meta(inp))
        if not inp.is_decode:  # a decode's rows are its sequences already
            hidden = hidden[inp.logits_indices]
        return self.model.compute_logits(hidden)

    # -- sampled ids --------------------------------------------------------

    def keep_sampled(self, token_ids: torch.Tensor) -> SampledIds:
        """Keep a step's sampled ids on the device for the next step's inputs, and
        start their copy to the host."""
        k = token_ids.numel()
        if token_ids is self.argmax and self.argmax_on_host:  # a decode graph's: copied out
            parity = self.parity
            return SampledIds(
                self.sampled_host_rows[parity][k],
                self.staged_sent[parity],
                self,
                self.sampled_host_np[parity][:k],
            )
        sampled = self.sampled_rows[k]
        if token_ids.data_ptr() != sampled.data_ptr():
            sampled.copy_(token_ids)
        if not self.sampled_host:
            return SampledIds(token_ids, None, self)  # CPU: a fresh tensor, nothing to wait for
        host = self.sampled_host_rows[self.parity][k]
        host.copy_(sampled, non_blocking=True)
        done = self.sampled_done[self.parity]
        done.record(self.stream)
        return SampledIds(host, done, self)

    def wait(self, fence: Fence) -> None:
        if not fence.pending:
            return
        # query() first: synchronize() releases the GIL even when nothing is pending.
        if not fence.event.query():
            if self.idle_work is not None:
                self.idle_work()
            start = time.perf_counter()
            fence.event.synchronize()
            self.wait_s += time.perf_counter() - start
        fence.pending = False

    # -- CUDA graphs ------------------------------------------------------

    def _pad_decode(self, start: int, end: int) -> None:
        """Padded entries: context 0 (nothing read), slot -1 (nothing written)."""
        self.buf["input_ids"][start:end] = 0
        self.buf["input_gather"][start:end] = self.ids_offset + self.arange[start:end]
        self.buf["positions"][start:end] = 0
        self.buf["slot_mapping"][start:end] = -1
        self.buf["seq_lens"][start:end] = 0
        self.buf["slot_indices"][start:end] = 0
        self.buf["query_start_loc"][start + 1 : end + 1] = self.arange[start + 1 : end + 1]
        self.buf["logits_indices"][start:end] = self.arange[start:end]

    def _pad_tokens(self, start: int, end: int) -> None:
        """Padded tokens of a prefill graph's step: id 0 at position 0, stored nowhere,
        and past the last sequence's query, so attention leaves their rows alone."""
        self.buf["input_ids"][start:end] = 0
        self.buf["input_gather"][start:end] = self.ids_offset + self.arange[start:end]
        self.buf["positions"][start:end] = 0
        self.buf["slot_mapping"][start:end] = -1

    def _pad_seqs(self, start: int, num_tokens: int, num_sampling: int) -> None:
        """Sequences start.. up to max_num_seqs, for a prefill graph: no query (their
        query starts all sit at the end), no context, block-table row 0; and logits
        rows past the sampling ones read token 0 (their argmax is never read)."""
        end = self.max_num_seqs
        self.buf["query_start_loc"][start + 1 : end + 1] = num_tokens
        self.buf["seq_lens"][start:end] = 0
        self.buf["slot_indices"][start:end] = 0
        self.buf["logits_indices"][num_sampling:end] = 0

    @torch.inference_mode()
    def _capture_prefill_graphs(self) -> None:
        """One graph per token bucket for max_num_seqs sequences, the largest first, in
        one memory pool (they never run at once). The bound on query lengths (it
        picks the attention's tile height) is the bucket's size or max_model_len.
        Like a decode graph, each writes the block-table entries the staging buffer
        carries, and takes logits for max_num_seqs rows and their argmax into the
        device buffer the next step's inputs are gathered from."""
        sizes = self.config.prefill_graph_sizes()
        pool = torch.cuda.graph_pool_handle()
        seqs = self.max_num_seqs
        sampled = self.staged.gpu["sampled_ids"]
        table = self.block_table.gpu.view(-1)
        table_index, table_value = self.staged.gpu["table_index"], self.staged.gpu["table_value"]
        for bucket in reversed(sizes):
            self._pad_tokens(0, bucket)
            self.buf["query_start_loc"][0] = 0
            self._pad_seqs(0, 0, 0)
            max_query_len = min(bucket, self.config.max_model_len)
            inp = self._send(bucket, seqs, max_query_len, False)
            self._forward(inp)  # warm up: Triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                table.index_copy_(0, table_index, table_value)
                logits = self._forward(inp)  # the block-table gather included
                torch.argmax(logits, dim=-1, out=sampled[:seqs])
            self.prefill_graphs[bucket] = (graph, logits)
        self.prefill_bucket = [min(b for b in sizes if b >= n) for n in range(sizes[-1] + 1)]
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def _capture_decode_graphs(self) -> None:
        # Every replay's fill writes the same static storage the capture read. Each
        # bucket has a graph per staging buffer: it copies that buffer in first, and
        # its greedy ids out to the same step's sampled-ids buffer last.
        pool = None
        sampled = self.staged.gpu["sampled_ids"]
        table = self.block_table.gpu.view(-1)
        table_index, table_value = self.staged.gpu["table_index"], self.staged.gpu["table_value"]
        for bucket in reversed(self.config.cuda_graph_batch_sizes()):
            self.buf["query_start_loc"][0] = 0
            self._pad_decode(0, bucket)
            inp = self._send(bucket, bucket, 1, True)
            self._forward(inp)  # warm up: Triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize(self.device)
            self.graphs[bucket], self.graph_logits[bucket] = [], []
            for i in range(self.num_buffers):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.staged.staged.copy_(self.staged.hosts[i], non_blocking=True)
                    table.index_copy_(0, table_index[:bucket], table_value[:bucket])
                    logits = self._forward(inp)
                    # Greedy ids, where keep_sampled would put them: a batch that needs
                    # the sampler overwrites them after the replay (~3 us of GPU time
                    # wasted then), and copies its own to the host again.
                    torch.argmax(logits, dim=-1, out=sampled[:bucket])
                    self.sampled_host[i][:bucket].copy_(sampled[:bucket], non_blocking=True)
                pool = graph.pool()
                self.graphs[bucket].append(graph)
                self.graph_logits[bucket].append(logits)
        torch.cuda.synchronize(self.device)
