"""Tensors in, logits out: the KV cache, the step's inputs, and the forward.

A step's inputs are written and sent in one copy (engine/step_inputs.py); input ids
are gathered on the device, from the host's ids or from the previous step's sampled
ids, which never visit the host first. Decode-only steps and steps with up to 2048
tokens replay CUDA graphs (engine/cuda_graphs.py); the rest run eagerly.
"""

from __future__ import annotations

import logging
from functools import partial

import torch
from torch import nn

from engine.block_table import BlockTable
from engine.config import STEP_PATHS, EngineConfig
from engine.cuda_graphs import CudaGraphs
from engine.distributed import SINGLE
from engine.images import ImageRows, plan_images
from engine.input_batch import InputBatch
from engine.models import gated_delta
from engine.models.layers import (
    AttentionMetadata,
    AttentionOps,
    PagedAttention,
    RecurrentLayer,
    SequenceSpans,
    SequenceWalk,
    allocate_states,
    state_bytes,
)
from engine.pooling import PooledRows, pool, pooling_rows
from engine.prompt_logprobs import SCORE_ROWS, PromptScoring, plan_scoring, score_prompts
from engine.scheduler import SchedulerOutput
from engine.staging import SampledIds, WaitClock
from engine.step_channel import EAGER, StepChannel, StepHeader
from engine.step_inputs import ModelInput, StepInputs
from engine.tp_group import Membership, all_ranks_min
from kernels.fp8 import FP8_DTYPE, check_fp8_device

logger = logging.getLogger("pagoda.engine")

CPU_KV_CACHE_BYTES = 1 << 30  # the CPU has no free-memory figure worth trusting


class ModelRunner(StepInputs):
    """With tensor parallelism, one per rank: rank 0's fills and schedules the steps and
    publishes each to the others (engine/step_channel.py), whose runners replay it
    (engine/tp_worker.py) with no InputBatch of their own (`batch` None)."""

    def __init__(
        self,
        config: EngineConfig,
        model: nn.Module,
        batch: InputBatch | None,
        membership: Membership | None = None,
    ) -> None:
        self.config = config
        self.tp = membership.tp if membership is not None else SINGLE
        self.model = model
        self.lora_slots = getattr(model, "lora_slots", None)  # engine/models/lora_slots.py
        self.lora_state = None if self.lora_slots is None else self.lora_slots.state
        self.device = config.torch_device
        self.dtype = next(model.parameters()).dtype
        self.kv_dtype = self.dtype
        self.attn_layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
        if config.kv_cache_dtype == "fp8":
            check_fp8_device(self.device)
            self.kv_dtype = FP8_DTYPE
        self.block_size = config.block_size
        self.max_num_seqs = seqs = config.max_num_seqs
        self.max_blocks_per_seq = config.max_blocks_per_seq(config.max_model_len)
        self.prompts_apart = any(layer.PROMPTS_APART for layer in self.attn_layers)

        # Recurrent layers' states by request slot, before the KV cache takes what is left.
        self.state_layers = [m for m in model.modules() if isinstance(m, RecurrentLayer)]
        # Prompts up to this long walk their tokens (graph-safe); longer ones run chunked.
        self.walk_limit = gated_delta.walk_limit(self.state_layers, self.device)
        self.graph_limit = gated_delta.graph_limit(self.state_layers, self.device)
        self._allocate_states()
        self.num_blocks = self._num_kv_blocks()
        if membership is not None:  # every rank holds the same blocks: the fewest any fits
            self.num_blocks = all_ranks_min(self.num_blocks, membership)
        self._allocate_kv_cache()
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB)",
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.block_size,
            self.num_blocks * self.bytes_per_block() / 2**30,
        )

        self.clock = WaitClock()
        self.block_table = BlockTable(
            seqs,
            self.max_blocks_per_seq,
            config.block_size,
            self.device,
            self.clock,
            track_rows=self.tp.size > 1,
        )
        super().__init__(config, batch, self.block_table, self.clock)  # the staging buffers
        self.argmax: torch.Tensor | None = None  # a graph's greedy ids: see execute()
        self.argmax_on_host = False
        self.prompt_scores: PromptScoring | None = None  # a step's prompt logprobs: see execute()
        self.pooled: PooledRows | None = None  # a step's embeddings: see execute()
        # Steps by how they ran, read by the server's periodic stats line.
        self.steps_by_path = dict.fromkeys(STEP_PATHS, 0)
        self.channel = (
            StepChannel(
                self.tp,
                membership.control,
                self.staged,
                self.block_table,
                self.device,
                (model.config.hidden_size, self.dtype),
            )
            if membership is not None
            else None
        )
        self.graphs = CudaGraphs(self)

    @property
    def wait_s(self) -> float:
        """Seconds the host spent blocked on the device."""
        return self.clock.seconds

    def bytes_per_block(self) -> int:
        """A block's bytes over every layer's cache (Gemma 4's global layers' heads are
        larger and fewer than its sliding layers')."""
        per_token = sum(
            layer.KV_TENSORS * layer.num_kv_heads * layer.head_dim for layer in self.attn_layers
        )
        return per_token * self.kv_dtype.itemsize * self.block_size

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        budget = self._cache_budget()
        useful = self.max_num_seqs * self.max_blocks_per_seq  # more could never be used
        per_block = self.bytes_per_block()  # 0: no attention layers (a Mamba-2 model)
        num_blocks = useful if per_block == 0 else min(int(budget // per_block), useful)
        if num_blocks < self.max_blocks_per_seq:
            raise ValueError(
                f"only {num_blocks} KV blocks fit in memory, fewer than one max_model_len sequence "
                f"needs ({self.max_blocks_per_seq}); lower max_model_len or raise gpu_memory_utilization"
            )
        return num_blocks

    def _cache_budget(self) -> float:
        """Bytes the caches may take: on CUDA what gpu_memory_utilization leaves free
        beside the activations' reserve."""
        if self.device.type != "cuda":
            return CPU_KV_CACHE_BYTES
        free, total = torch.cuda.mem_get_info(self.device)
        budget = total * self.config.gpu_memory_utilization - (total - free)
        return budget - self._activation_reserve()

    def _activation_reserve(self) -> int:
        """Bytes kept free for activations, logits and graph pools (a generous estimate)."""
        hf = self.model.config
        hidden = getattr(hf, "hidden_size", None) or hf.n_embd
        inner = getattr(hf, "intermediate_size", None) or 4 * hidden
        tokens = self.config.max_num_batched_tokens
        activations = tokens * (4 * hidden + 3 * inner) * self.dtype.itemsize
        # fp32 logits and sampler (or prompt-logprob) temporaries.
        logits = max(self.max_num_seqs, SCORE_ROWS) * hf.vocab_size * 4 * 4
        return int(2 * (activations + logits)) + (512 << 20)

    def _allocate_states(self) -> None:
        """Each recurrent layer's states: a row per request slot, the spare row a graph's
        padded rows read and write (slot max_num_seqs), then the prefix cache's
        snapshot rows (engine/state_snapshots.py)."""
        if not self.state_layers:
            return
        snapshots = self.config.state_snapshots
        rows = self.max_num_seqs + 1 + snapshots
        need = state_bytes(self.state_layers, rows, self.dtype)
        budget = self._cache_budget()
        if need > budget:
            also = f" and {snapshots} snapshots for the prefix cache" if snapshots else ""
            raise ValueError(
                f"the recurrent states of max_num_seqs={self.max_num_seqs} sequences{also} "
                f"need {need / 2**30:.1f} GiB, more than the {budget / 2**30:.1f} GiB left "
                "for caches; lower max_num_seqs (or raise gpu_memory_utilization"
                + (", or turn the prefix cache off)" if snapshots else ")")
            )
        allocate_states(self.state_layers, rows, self.dtype, self.device)
        logger.info(
            "recurrent states: %d layers, %.2f GiB for %d sequences and %d snapshots",
            len(self.state_layers),
            need / 2**30,
            self.max_num_seqs,
            snapshots,
        )

    def _allocate_kv_cache(self) -> None:
        ops = AttentionOps.for_device(self.device)
        for layer in self.attn_layers:
            shape = (self.num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            layer.v_cache = layer.k_cache
            if layer.KV_TENSORS == 2:
                layer.v_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            layer.ops = ops
            if self.kv_dtype == FP8_DTYPE:  # the cache kernels bound to the layer's k/v scales
                scales = dict(k_scale=layer.k_scale, v_scale=layer.v_scale)
                kernels = (ops.store, ops.decode, ops.prefill)
                layer.ops = AttentionOps(*(partial(op, **scales) for op in kernels))

    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Logits [num_sampling, vocab] at the last new token of each sequence that
        samples (out.samples: every one but the prefill chunks that stop short), and
        before it at each draft token it verifies ([out.num_logits, vocab] in all).

        Also sets `argmax` (after a graph, their argmax ids on the device; None after
        an eager step), `argmax_on_host` (the graph copied them to the host too, as a
        decode graph does), `prompt_scores` (engine/prompt_logprobs.py; None when
        no sequence scores its prompt, as in every decode step) and `pooled`
        (engine/pooling.py: the embeddings of the rows that pool, else None). A graph
        replay runs no torch op, so only the other paths enter inference mode."""
        max_query_len = self.fill(out)
        self.argmax = None
        self.argmax_on_host = False
        self.prompt_scores = None
        self.pooled = None
        # Logits rows: a sampling sequence's last token's, and one per draft it verifies
        # (engine/speculative.py), in sequence order.
        num_seqs, num_tokens, num_sampling = out.num_seqs, out.num_tokens, out.num_logits
        pooling = pooling_rows(out, self.batch)  # a prompt's last token (maybe all that is left)
        # A prompt's image features in place of its placeholders' embeddings: eager.
        images = plan_images(out, self.batch)
        copies = out.state_copies  # copied around an eager forward
        eager = pooling is not None or images is not None or copies is not None
        if out.is_decode_only and self.graphs.decode and not eager:
            return self.graphs.replay_decode(num_seqs)  # a bucket holds any batch
        per_token = self.per_token  # a verify step's tokens attend as sequences
        if per_token and self.graphs.verify:
            return self.graphs.replay_verify(num_tokens)
        scoring = plan_scoring(out, self.batch) if self.batch.num_scoring else None
        graph = scoring is None and not eager
        with torch.inference_mode():
            prefill_graph = num_tokens < len(self.graphs.prefill_bucket)
            if graph and prefill_graph and not per_token and num_sampling <= self.max_num_seqs:
                return self.graphs.replay_prefill(num_tokens, num_seqs, num_sampling)
            if per_token:
                num_seqs = num_tokens
            # Only an eager step runs whole prompts apart: a graph is captured for one path.
            prompts_only = self.prompts_apart and self.prompts_only
            restores = saves = 0
            if copies is not None:
                restores, saves = copies.num_restores, copies.num_saves
                self.buf["state_source"][: restores + saves] = copies.source
                self.buf["state_target"][: restores + saves] = copies.target
            inp = self.send(
                num_tokens,
                num_seqs,
                max_query_len,
                out.is_decode_only,
                num_sampling,
                per_token,
                prompts_only,
                restores,
                saves,
            )
            if self.channel is not None:
                rows = None if scoring is None else torch.from_numpy(scoring.rows).to(self.device)
                header = StepHeader(
                    EAGER,
                    num_tokens=num_tokens,
                    num_seqs=num_seqs,
                    max_query_len=max_query_len,
                    is_decode=int(out.is_decode_only),
                    num_sampling=num_sampling,
                    per_token=int(per_token),
                    prompts_only=int(prompts_only),
                    state_restores=restores,
                    state_saves=saves,
                )
                self.channel.publish(header, rows, images)
            self.steps_by_path["eager"] += 1
            if graph:
                return self.forward(inp)
            hidden = self.hidden_states(inp, images)  # [num_tokens, hidden_size]
            if scoring is not None:
                self.prompt_scores = score_prompts(hidden, scoring, self.model.compute_logits)
            last = hidden[inp.logits_indices]  # [num_sampling, hidden_size]
            if pooling is not None:
                classifier = getattr(self.model, "classifier", None)
                method = self.config.pooling_type or "LAST"
                dense = getattr(self.model, "projector", None)
                self.pooled = pool(hidden, last, pooling, out, method, classifier, dense)
            return self.model.compute_logits(last)

    def hidden_states(self, inp: ModelInput, images: ImageRows | None = None) -> torch.Tensor:
        # Gathered here, so that a captured graph gathers the ids and rows on every replay.
        input_ids = self.staged.words[inp.input_gather]
        if self.lora_state is not None:  # the adapters' masks, from the tokens' ids
            self.lora_state.begin(inp.lora_ids)
        block_table = self.block_table.gpu[inp.slot_indices]  # [num_seqs, max_blocks_per_seq]
        meta = AttentionMetadata(
            inp.slot_mapping,
            block_table,
            inp.seq_lens,
            inp.query_start_loc,
            inp.max_query_len,
            inp.is_decode,
            inp.per_token,
            None if images is None else images.horizons(inp.positions),
            prompts_only=inp.prompts_only,
            state_slots=inp.slot_indices,
        )
        if self.state_layers and not inp.is_decode:
            if inp.max_query_len <= self.walk_limit:  # device ops: a graph remakes it
                meta.walk = SequenceWalk.of(meta, len(input_ids))
            else:  # an eager step's shape, on the host
                meta.spans = SequenceSpans.of(meta)
        if inp.state_restores:  # states into slots, before they are read
            self.copy_states(inp.state_source, inp.state_target, 0, inp.state_restores)
        if images is not None:
            hidden = self.model(input_ids, inp.positions, meta, images)
        else:
            hidden = self.model(input_ids, inp.positions, meta)
        if inp.state_saves:  # slots' states as this step leaves them, into snapshots
            end = inp.state_restores + inp.state_saves
            self.copy_states(inp.state_source, inp.state_target, inp.state_restores, end)
        return hidden

    def copy_states(self, source: torch.Tensor, target: torch.Tensor, lo: int, hi: int) -> None:
        """Rows source[lo:hi] of every recurrent state into rows target[lo:hi]."""
        source, target = source[lo:hi], target[lo:hi]
        for layer in self.state_layers:
            for name in layer.state_shapes():
                state = getattr(layer, name)
                state.index_copy_(0, target, state.index_select(0, source))

    def forward(self, inp: ModelInput, images: ImageRows | None = None) -> torch.Tensor:
        hidden = self.hidden_states(inp, images)
        if not inp.is_decode:  # a decode's rows are its sequences already
            hidden = hidden[inp.logits_indices]
        return self.model.compute_logits(hidden)

    def keep_sampled(self, token_ids: torch.Tensor) -> SampledIds:
        """Keep a step's sampled ids on the device for the next step's inputs, and
        start their copy to the host."""
        if token_ids is self.argmax and self.argmax_on_host:  # a decode graph's: copied out
            parity = self.parity
            return SampledIds(
                self.sampled.host_np[parity][: token_ids.numel()], self.staged_sent[parity]
            )
        return self.sampled.keep(token_ids, self.parity)
