"""CUDA graphs: decode steps by batch bucket, steps with prefill by token bucket.

Decode-only steps replay a graph captured for the next bucket up in batch
size; padded entries have context length 0 and slot -1, so they read and write
nothing. Each decode graph first reads in from its staging buffer the words a batch
of its size uses (there is one graph per buffer; kernels/host_copy.py), writes the
block-table entries the step opened, and ends with every row's argmax in the device
buffer the next step's inputs are gathered from, written to the host too: an
all-greedy batch (the common case) then launches nothing after the replay.

Speculative verify steps (a sequence's last sampled token and its drafts, every
token a logits row) replay a graph per token bucket in which each token attends as a
decode row of its own (AttentionMetadata.per_token), for as many tokens as the
decode buckets have sequences; their logits land in one buffer all of them share.

Steps with prefill tokens replay a whole-forward graph too, captured per token
bucket up to 2048 tokens, for as many sequences as the bucket has tokens (or
max_num_seqs; a step has no more): the prefill attention's grid depends on
those two counts only (kernels.prefill_attention), so padded tokens (slot -1)
and empty padded sequences make any such step fit. A model with recurrent layers
has buckets only as far as its prompts walk (ModelRunner.graph_limit), the
walk's grid likewise a function of the counts. Larger steps, and everything
under --enforce-eager, run eagerly.

With tensor parallelism every rank captures the same graphs, the model's
collectives inside; rank 0 copies and broadcasts the staging buffer before each
replay (engine/step_channel.py), so its decode graphs do not copy it in.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from engine.step_channel import DECODE_GRAPH, PREFILL_GRAPH, VERIFY_GRAPH, StepHeader
from kernels.argmax import greedy_ids
from kernels.host_copy import Segments, copy_segments, copy_to_host

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner

logger = logging.getLogger("pagoda.engine")


class CudaGraphs:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        config = runner.config
        # By bucket: one graph per staging buffer, each reading that buffer in; their logits.
        self.decode: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.decode_logits: dict[int, list[torch.Tensor]] = {}
        self.decode_segments: dict[int, Segments] = {}  # what each bucket's graphs read in
        self.decode_bucket = config.cuda_graph_bucket_table()
        # By token bucket: (graph, its logits [min(bucket, max_num_seqs), vocab]).
        self.prefill: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.prefill_bucket: list[int] = []  # entry n: the bucket a step of n tokens replays
        # Only rank 0's logits mean anything (another rank's graphs take no argmax).
        self.driver = runner.tp.is_driver
        # Captures run on a side stream: the legacy default stream cannot capture.
        self.capture_stream = torch.cuda.Stream(runner.device) if config.use_cuda_graphs else None
        if config.use_cuda_graphs:
            _timed("decode", "batch sizes", config.cuda_graph_batch_sizes(), self._capture_decode)
        if config.use_cuda_graphs and self.driver:
            # By buffer, then batch size: the logits rows of its bucket's graph.
            self.decode_rows = [
                [
                    self.decode_logits[self.decode_bucket[n]][i][:n] if n else None
                    for n in range(runner.max_num_seqs + 1)
                ]
                for i in range(runner.num_buffers)
            ]
        sizes = config.prefill_graph_sizes()
        if runner.state_layers:  # steps whose prompts walk, where a graph pays
            sizes = [s for s in sizes if s <= runner.graph_limit]
        if config.use_cuda_graphs and config.prefill_graphs and sizes:
            _timed("prefill", "token counts", sizes, self._capture_prefill)
        # By token bucket: the verify graphs, and the logits rows they all write.
        self.verify: dict[int, torch.cuda.CUDAGraph] = {}
        self.verify_logits: torch.Tensor | None = None
        if config.use_cuda_graphs and config.num_speculative_tokens:
            sizes = config.cuda_graph_batch_sizes()
            _timed("verify", "token counts", sizes, self._capture_verify)
            runner.max_per_token_rows = sizes[-1]

    def release(self) -> None:
        """Drop every graph, before the process group goes: NCCL's communicator teardown
        waits until no captured graph holds its collectives (ncclCommDestroy would hang)."""
        self.decode.clear()
        self.prefill.clear()
        self.verify.clear()

    def replay_decode(self, num_seqs: int) -> torch.Tensor:
        """Logits [num_seqs, vocab]; the runner's argmax is set, already on the host."""
        runner = self.runner
        bucket = self.decode_bucket[num_seqs]
        if bucket > num_seqs:
            self.pad_decode(num_seqs, bucket)
        runner.stage_table_changes(bucket)
        parity = runner.parity
        if runner.channel is not None:  # the staged copy goes first, then to the other ranks
            runner.copy_staged()
            runner.channel.publish(StepHeader(DECODE_GRAPH, bucket=bucket))
        self.decode[bucket][parity].replay()
        runner.staged_sent[parity].record(runner.stream)
        runner.steps_by_path["graph"] += 1
        runner.argmax = runner.sampled.device_rows[num_seqs]
        runner.argmax_on_host = True
        return self.decode_rows[parity][num_seqs]

    def replay_prefill(self, num_tokens: int, num_seqs: int, num_sampling: int) -> torch.Tensor:
        """Logits [num_sampling, vocab] of a step with prefill tokens; argmax set."""
        runner = self.runner
        bucket = self.prefill_bucket[num_tokens]
        self.pad_tokens(num_tokens, bucket)
        self.pad_seqs(num_seqs, num_tokens, num_sampling, min(bucket, runner.max_num_seqs))
        runner.stage_table_changes(runner.table_capacity)
        runner.copy_staged()
        if runner.channel is not None:
            runner.channel.publish(StepHeader(PREFILL_GRAPH, bucket=bucket))
        graph, logits = self.prefill[bucket]
        graph.replay()
        runner.steps_by_path["prefill graph"] += 1
        runner.argmax = runner.sampled.device_rows[num_sampling]
        return logits[:num_sampling]

    def replay_verify(self, num_tokens: int) -> torch.Tensor:
        """Logits [num_tokens, vocab] of a verify step (a row per token); argmax set."""
        runner = self.runner
        bucket = self.decode_bucket[num_tokens]
        if bucket > num_tokens:
            self.pad_decode(num_tokens, bucket)
        runner.stage_table_changes(runner.table_capacity)
        runner.copy_staged()
        if runner.channel is not None:
            runner.channel.publish(StepHeader(VERIFY_GRAPH, bucket=bucket))
        self.verify[bucket].replay()
        runner.steps_by_path["graph"] += 1
        runner.argmax = runner.sampled.device_rows[num_tokens]
        return self.verify_logits[:num_tokens]

    def pad_decode(self, start: int, end: int) -> None:
        """Padded entries: context 0 (nothing read), slot -1 (nothing written), the spare
        block-table row (and recurrent state row)."""
        self.pad_tokens(start, end)
        buf, arange = self.runner.buf, self.runner.arange
        buf["seq_lens"][start:end] = 0
        buf["slot_indices"][start:end] = self.runner.max_num_seqs
        buf["query_start_loc"][start + 1 : end + 1] = arange[start + 1 : end + 1]
        buf["logits_indices"][start:end] = arange[start:end]

    def pad_tokens(self, start: int, end: int) -> None:
        """Padded tokens of a prefill graph's step: id 0 at position 0, stored nowhere,
        and past the last sequence's query, so attention leaves their rows alone."""
        runner = self.runner
        buf = runner.buf
        buf["input_ids"][start:end] = 0
        buf["input_gather"][start:end] = runner.ids_offset + runner.arange[start:end]
        buf["positions"][start:end] = 0
        buf["slot_mapping"][start:end] = -1

    def pad_seqs(self, start: int, num_tokens: int, num_sampling: int, end: int) -> None:
        """Sequences start..end (a prefill graph's), padding: no query (their query
        starts all sit at the end), no context, the spare block-table row; and logits
        rows past the sampling ones read token 0 (their argmax is never read)."""
        buf = self.runner.buf
        buf["query_start_loc"][start + 1 : end + 1] = num_tokens
        buf["seq_lens"][start:end] = 0
        buf["slot_indices"][start:end] = self.runner.max_num_seqs
        buf["logits_indices"][num_sampling:end] = 0

    @torch.inference_mode()
    def _capture_prefill(self, sizes: list[int]) -> None:
        """One graph per token bucket, the largest first, in one memory pool (they never
        run at once), for as many sequences as it has tokens: fewer padded sequences,
        fewer attention programs that find no query. The bound on query lengths (it
        picks the attention's tile height) is the bucket's size or max_model_len."""
        runner = self.runner
        pool = torch.cuda.graph_pool_handle()
        gpu, table = runner.staged.gpu, runner.block_table.gpu.view(-1)
        sampled, index, values = gpu["sampled_ids"], gpu["table_index"], gpu["table_value"]
        for bucket in reversed(sizes):
            seqs = min(bucket, runner.max_num_seqs)
            self.pad_tokens(0, bucket)
            runner.buf["query_start_loc"][0] = 0
            self.pad_seqs(0, 0, 0, seqs)
            max_query_len = min(bucket, runner.config.max_model_len)
            # Logits rows: a step has no more than tokens (a row per sampling sequence,
            # and per draft it verifies).
            inp = runner.send(bucket, seqs, max_query_len, False, seqs)
            runner.forward(inp)  # warm up: Triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize(runner.device)
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, pool, self.capture_stream):
                table.index_copy_(0, index, values)
                logits = runner.forward(inp)  # the block-table gather included
                if self.driver:
                    greedy_ids(logits, sampled[: len(logits)])
            self.prefill[bucket] = (graph, logits)
        self.prefill_bucket = [min(b for b in sizes if b >= n) for n in range(sizes[-1] + 1)]
        torch.cuda.synchronize(runner.device)

    @torch.inference_mode()
    def _capture_verify(self, sizes: list[int]) -> None:
        """One graph per token bucket, the largest first, in one memory pool; each copies
        its logits into the shared verify_logits (a graph's own output would hold its
        memory for good)."""
        runner = self.runner
        pool = torch.cuda.graph_pool_handle()
        gpu, table = runner.staged.gpu, runner.block_table.gpu.view(-1)
        sampled, index, values = gpu["sampled_ids"], gpu["table_index"], gpu["table_value"]
        for bucket in reversed(sizes):
            runner.buf["query_start_loc"][0] = 0
            self.pad_decode(0, bucket)
            inp = runner.send(bucket, bucket, 1, False, bucket, True)
            logits = runner.forward(inp)  # warm up: Triton compiles, cuBLAS picks its kernels
            if self.verify_logits is None:
                self.verify_logits = torch.empty_like(logits)
            torch.cuda.synchronize(runner.device)
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, pool, self.capture_stream):
                table.index_copy_(0, index, values)
                rows = self.verify_logits[:bucket]
                rows.copy_(runner.forward(inp))
                if self.driver:
                    greedy_ids(rows, sampled[:bucket])
            self.verify[bucket] = graph
        torch.cuda.synchronize(runner.device)

    @torch.inference_mode()
    def _capture_decode(self, sizes: list[int]) -> None:
        # Every replay's fill writes the same static storage the capture read.
        runner = self.runner
        pool = None
        gpu, table = runner.staged.gpu, runner.block_table.gpu.view(-1)
        sampled, index, values = gpu["sampled_ids"], gpu["table_index"], gpu["table_value"]
        words = runner.staged.staged.view(torch.int64)
        host_words = [host.view(torch.int64) for host in runner.staged.hosts]
        for bucket in reversed(sizes):
            runner.buf["query_start_loc"][0] = 0
            self.pad_decode(0, bucket)
            inp = runner.send(bucket, bucket, 1, True)
            runner.forward(inp)  # warm up: Triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize(runner.device)
            self.decode[bucket], self.decode_logits[bucket] = [], []
            # Kept: the graphs read the ranges from this tensor on every replay.
            segments = self.decode_segments[bucket] = Segments.of(
                runner.decode_ranges(bucket), runner.device
            )
            # Another rank's graphs copy nothing in or out: one per bucket does.
            for i in range(runner.num_buffers if self.driver else 1):
                graph = torch.cuda.CUDAGraph()
                with capturing(graph, pool, self.capture_stream):
                    if runner.channel is None:  # with several ranks, copied before the replay
                        copy_segments(words, host_words[i], segments)
                    table.index_copy_(0, index[:bucket], values[:bucket])
                    logits = runner.forward(inp)
                    # Greedy ids, where keep_sampled would put them: a batch that needs
                    # the sampler overwrites them after the replay, and copies its own
                    # to the host again.
                    if self.driver:
                        greedy_ids(logits, sampled[:bucket])
                        copy_to_host(runner.sampled.hosts[i][:bucket], sampled[:bucket])
                pool = graph.pool()
                self.decode[bucket].append(graph)
                self.decode_logits[bucket].append(logits)
        torch.cuda.synchronize(runner.device)


@contextlib.contextmanager
def capturing(
    graph: torch.cuda.CUDAGraph,
    pool: tuple[int, int] | None,
    stream: torch.cuda.Stream,
    error_mode: str = "global",
) -> Iterator[None]:
    """torch.cuda.graph without its synchronize and cache emptying before each capture,
    which over a hundred captures in a row hand each warm-up's memory back to the
    driver for the next to allocate again (vLLM skips the emptying too). The captures
    here follow a synchronize of their own, or allocate nothing. error_mode
    "thread_local" lets other threads go on using CUDA meanwhile."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode=error_mode)
        try:
            yield
        finally:
            graph.capture_end()


def _timed(kind: str, what: str, sizes: list[int], capture: Callable[[list[int]], None]) -> None:
    """Run capture(sizes), logging which sizes (as "1, 2, 4, ..., 256 (35 sizes)") and how long."""
    shown = sizes if len(sizes) <= 6 else [*sizes[:3], "...", f"{sizes[-1]} ({len(sizes)} sizes)"]
    logger.info("capturing %s graphs for %s %s", kind, what, ", ".join(map(str, shown)))
    start = time.perf_counter()
    capture(sizes)
    logger.info("%s graphs captured in %.1f s", kind, time.perf_counter() - start)
