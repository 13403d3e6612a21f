"""The engine: add requests, step, read deltas. Single-threaded by design; the
server drives it from one background thread.

Outputs are built when asked for (`step(emit=True)` or `take_outputs()`), not
per token: a consumer that falls behind (the server's event loop under load)
asks less often and gets fewer, larger deltas, so the cost of detokenizing and
building outputs follows its pace, not the token rate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.checks import UnknownAdapter, check_request
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.distributed import SINGLE
from engine.generation_config import load_generation_config
from engine.images import ImageInputs, encode_prompt_images
from engine.input_batch import InputBatch
from engine.kv_cache import BlockManager, adapter_root, salted_root
from engine.model_runner import ModelRunner
from engine.models.bert import is_encoder, token_types
from engine.models.demo import DEMO_MODEL_NAME, ensure_demo_model
from engine.models.loader import load_config, load_for_engine, load_tokenizer, max_model_len
from engine.models.lora import LoRAError
from engine.models.registry import MODEL_TYPES
from engine.models.vision import vision_encoder
from engine.outputs import take_outputs, take_plain
from engine.pooling import pooling_type, projector
from engine.request import Request, RequestOutput, TokenDeltas
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.speculative import NgramSpeculator
from engine.stats import EngineStats, lora_stats
from engine.step_reader import LaunchedStep, StepReader
from engine.tp_group import Membership, WorkerFailed, Workers, leave, start_driver

if TYPE_CHECKING:  # xgrammar is imported with the first structured request
    from engine.structured.grammars import Grammars

logger = logging.getLogger("pagoda.engine")


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_dir = model_dir = config.model or ensure_demo_model()
        self.model_name = Path(model_dir).name if config.model else DEMO_MODEL_NAME
        logger.info("building the engine for %s", model_dir)  # its modules are imported
        hf_config = load_config(model_dir)
        limit = max_model_len(hf_config)
        if config.max_model_len is None:
            config.max_model_len = limit
        elif config.max_model_len > limit:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's limit of {limit} tokens"
            )
        if is_encoder(hf_config):
            config.encoder_only()
        if getattr(MODEL_TYPES[hf_config.model_type], "recurrent", lambda _: False)(hf_config):
            config.recurrent_model()
        if config.pooling_type is None:
            config.pooling_type = pooling_type(model_dir, hf_config)
        if config.whole_pooling_prompts:  # the longest prompt fits one step
            config.max_num_batched_tokens = max(config.max_num_batched_tokens, config.max_model_len)
        device = config.torch_device
        # Tensor parallelism: the other ranks start loading beside this one.
        self.workers: Workers | None = None
        membership: Membership | None = None
        if config.tensor_parallel_size > 1:
            self.workers, membership = start_driver(config)
        try:
            tp = membership.tp if membership is not None else SINGLE
            start = time.perf_counter()
            self.model = load_for_engine(config, model_dir, hf_config, tp)
            # An embedding's sentence-transformers Dense modules, which the pooling applies.
            dense = projector(model_dir)
            self.model.projector = None if dense is None else dense.to(device)
            self.vision = vision_encoder(model_dir, device, next(self.model.parameters()).dtype)
            self.embedding_size = hf_config.hidden_size if dense is None else dense.out_features
            self.tokenizer = load_tokenizer(model_dir)
            self.vocab_size = hf_config.vocab_size
            self.token_types = token_types(hf_config)
            # A bare model (no LM head in its checkpoint) embeds and generates nothing; a
            # sequence classifier classifies (engine/pooling.py) and does neither.
            self.can_generate = getattr(self.model, "has_lm_head", True)
            head = getattr(self.model, "classifier", None)
            num_labels = 0 if head is None else head.num_labels
            names = getattr(hf_config, "id2label", None) or {}
            self.labels = [names.get(i, f"LABEL_{i}") for i in range(num_labels)]
            eos = getattr(hf_config, "eos_token_id", None)
            eos = [*(eos if isinstance(eos, list) else [eos]), self.tokenizer.eos_token_id]
            eos += load_generation_config(model_dir).eos_token_ids
            self.eos_token_ids = sorted({i for i in eos if i is not None})
            self.eos_set = frozenset(self.eos_token_ids)

            self.batch = InputBatch(config.max_num_seqs, config.max_model_len, self.vocab_size)
            self.runner = ModelRunner(config, self.model, self.batch, membership)
        except BaseException as exc:
            if self.workers is not None:
                try:
                    self.workers_failed(exc)  # a rank's death, if that is what failed
                finally:
                    self.shutdown()
            raise
        config.num_kv_blocks = self.runner.num_blocks  # as sized: what stats pages show
        self.blocks = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.blocks, self.batch, self.runner.block_table)
        self.sampler = Sampler(self.vocab_size, device, config.seed, self.eos_token_ids, self.batch)
        self.speculator = (
            NgramSpeculator(config, self.batch, self.sampler)
            if config.num_speculative_tokens
            else None
        )
        self.inflight: LaunchedStep | None = None  # launched; its ids not read yet
        self.num_sampled = 0  # sampled rows, cumulative (void ones included)
        self._grammars: Grammars | None = None  # built with the first structured request
        # NVTX ranges around the step's phases, for nsys.
        nvtx = config.nvtx and device.type == "cuda"
        self._range = torch.cuda.nvtx.range if nvtx else contextlib.nullcontext
        self.reader = StepReader(
            self.batch, self.blocks, self.scheduler, self.eos_set, config, self._range
        )
        self.requests = self.reader.requests  # client id -> its n choices, while any runs
        self.news = self.reader.news  # requests with output not taken yet (ordered)
        logger.info("engine ready in %.1f s", time.perf_counter() - start)

    def workers_failed(self, exc: BaseException) -> None:
        """Raise WorkerFailed if a rank's death explains exc (a failed collective)."""
        if self.workers is not None and not isinstance(exc, WorkerFailed):
            self.workers.explain(exc)

    def shutdown(self) -> None:
        """Stop the other ranks (if any) and leave the group; the engine is done."""
        workers = self.workers
        if workers is None or workers.stopping:
            return
        channel = getattr(getattr(self, "runner", None), "channel", None)
        if workers.failure is None and channel is not None:
            with contextlib.suppress(Exception):
                channel.stop()
        workers.join(timeout=10.0)
        if channel is not None:
            self.runner.graphs.release()  # before the group: NCCL waits for its graphs
        leave()

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Reject what can never run, before any work is done. Safe from any thread but
        for bad_words given without their token ids (the server tokenizes them itself)."""
        params.with_bad_words(lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        if params.priority and self.config.scheduling_policy != "priority":
            raise ValueError(
                f"priority {params.priority} needs priority scheduling (--scheduling-policy "
                "priority)"
            )
        check_request(
            prompt_token_ids, params, self.config.max_model_len, self.vocab_size, self.token_types
        )
        self.lora_index(params.lora_name)
        if not params.pooling and not self.can_generate:
            raise ValueError("this model has no LM head: it serves embeddings only")

    def lora_index(self, name: str | None) -> int:
        """The adapter's slot (-1: None, the base model); UnknownAdapter if not loaded."""
        slots = self.runner.lora_slots
        if slots is None and name is not None:
            raise UnknownAdapter(f"unknown LoRA adapter {name!r} (loaded: none)")
        return -1 if slots is None else slots.index(name)

    def load_lora(self, name: str, path: str, replace: bool = False) -> None:
        """Serve a PEFT adapter as `name` from the next step on (needs enable_lora), on
        every rank; replace: new weights for a loaded `name` (LoRASlots.load). LoRAError
        says why not."""
        if self.runner.lora_slots is None:
            raise LoRAError("LoRA adapters load while serving only with --enable-lora")
        busy = {req.lora_index for choices in self.requests.values() for req in choices}
        slot = self.runner.lora_slots.load(name, path, busy, replace)
        if self.runner.channel is not None:
            self.runner.channel.publish_lora(slot, name, path)

    def unload_lora(self, name: str) -> None:
        """New requests may no longer name it; those running finish with it."""
        self.lora_index(name)  # UnknownAdapter if it is not loaded
        self.runner.lora_slots.unload(name)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        images: ImageInputs | None = None,
    ) -> None:
        """images: the prompt's, whose placeholder ids it holds (engine/images.py)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_request(prompt_token_ids, params)
        prompt_images = None
        if images is not None:
            prompt_images = encode_prompt_images(
                self.vision, prompt_token_ids, images, self.config.max_num_batched_tokens
            )
        lora_index = self.lora_index(params.lora_name)
        arrival_time = arrival_time or time.time()
        choices: list[Request] = []
        for index in range(params.n):
            choice_params = params
            if index > 0 and params.seed is not None:
                # Each choice draws its own stream, reproducibly.
                choice_params = dataclasses.replace(params, seed=params.seed + index)
            first = choices[0] if choices and self.config.enable_prefix_caching else None
            req = Request(
                request_id, prompt_token_ids, choice_params, index, arrival_time, wait_for=first
            )
            if choice_params.detokenize:
                req.detokenizer = IncrementalDetokenizer(
                    self.tokenizer, req.prompt_token_ids, choice_params
                )
            if lora_index >= 0:  # its blocks chain from a root of this load's own
                serial = self.runner.lora_slots.serials[lora_index]
                req.lora_index, req.hash_root = lora_index, adapter_root(serial)
            if params.cache_salt is not None:
                req.hash_root = salted_root(req.hash_root, params.cache_salt)
            if images is not None:  # the same text with other images: another prompt
                req.images = prompt_images
                req.hash_root = salted_root(req.hash_root, f"images:{images.digest}")
            eos = frozenset() if choice_params.ignore_eos else self.eos_set
            req.stop_ids = eos | frozenset(choice_params.stop_token_ids)
            if params.grammar is not None:  # a matcher per choice
                req.structured = self.grammars.state(request_id, params.grammar)
            choices.append(req)
            self.scheduler.add(req)
        self.requests[request_id] = choices

    def abort_request(self, request_id: str) -> None:
        for req in self.requests.pop(request_id, []):
            self.news.pop(req, None)  # nobody is waiting for it any more
            if not req.is_finished:
                self.scheduler.finish(req, "abort")
        step = self.inflight
        if step is None:
            return
        # Does some row's ids still belong to a request: running, or preempted meanwhile?
        batch, generations = self.batch, step.mark.generations
        owned = (batch.generation[step.slots] == generations).any() or any(
            (slot, gen) in batch.departed
            for slot, gen in zip(step.slots.tolist(), generations.tolist())
        )
        if not owned:
            self.inflight = None  # nothing left to read: its device work is simply void

    @property
    def grammars(self) -> Grammars:
        """Structured outputs' compiler and matchers (its tokenizer info takes a while)."""
        if self._grammars is None:
            from engine.structured.grammars import Grammars

            self._grammars = Grammars(
                self.tokenizer,
                self.vocab_size,
                self.eos_token_ids,
                self.config.max_num_seqs,
                self.config.torch_device,
                logits_dtype=self.runner.dtype,
                ids_out=self.runner.sampled.device_rows[-1],
            )
        return self._grammars

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self.inflight is not None

    def get_stats(self) -> EngineStats:
        spec, slots = self.speculator, self.runner.lora_slots
        return EngineStats(
            num_running=len(self.batch),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.blocks.usage,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.blocks.prefix_queries,
            prefix_cache_hits=self.blocks.prefix_hits,
            spec_decode_num_draft_tokens=spec.num_draft_tokens if spec else 0,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
            **(
                {}
                if slots is None
                else lora_stats(slots, self.batch.lora[self.batch.slots], self.scheduler.waiting)
            ),
        )

    def step(self, emit: bool = True, deltas: TokenDeltas | None = None) -> list[RequestOutput]:
        """Run one step (see _step); with tensor parallelism, a rank that died fails it."""
        workers = self.workers
        if workers is None:
            return self._step(emit, deltas)
        workers.check()
        try:
            return self._step(emit, deltas)
        except WorkerFailed:
            raise
        except Exception as exc:
            self.workers_failed(exc)
            # The ranks may no longer agree on which collectives ran: none can go on.
            raise WorkerFailed(f"a tensor-parallel step failed: {exc}") from exc

    def _step(self, emit: bool, deltas: TokenDeltas | None) -> list[RequestOutput]:
        """Run one step; return the news it brings (mostly the previous step's tokens).

        emit=False keeps the news for a later step or take_outputs(), which then
        report it together. With deltas, the outputs of plain streams between
        their first and last go there instead (see take_outputs).

        The host runs one step ahead of the device: it schedules and launches
        step N (whose decodes read step N-1's sampled ids on the device), and
        only then reads N-1's ids, appends them, matches stops and notes news,
        while the GPU runs N. A request that stopped at N-1 wastes its row in N;
        its token there is void. Penalties and logprobs need the ids on the
        host, so a step with such a request reads N-1 before sampling and its
        own ids at once. A step with grammar rows reads N-1 before sampling too, as
        a grammar that N-1's id completes ends its request (engine/structured/masks.py
        says how step N's masks are filled meanwhile)."""
        grammars = self._grammars
        if grammars is not None and grammars.waiting:  # raises for failed compilations
            idle = not self.scheduler.running and self.inflight is None
            grammars.check_compiled(0.01 if idle else 0.0)  # idle: wait a little, not spin
        with self._range("schedule"):
            if self.speculator is not None:
                self.speculator.propose()
            out = self.scheduler.schedule()
        prev, self.inflight = self.inflight, None
        if out:
            with self._range("forward"):
                logits = self.runner.execute(out)  # the sampling rows only
            if out.num_drafts is not None:  # speculation: no step is in flight
                with self._range("sample"):
                    verified = self.speculator.verify(logits, out, self.runner.argmax)
                self.num_sampled += self.speculator.read(out, verified, logits, self.reader)
                return self.take_outputs(deltas) if emit else []
            if self.runner.prompt_scores is not None:  # before any first output is built
                self.reader.keep_prompt_logprobs(self.runner.prompt_scores)
            pooled = self.runner.pooled
            if pooled is not None:
                self.reader.keep_embeddings(pooled)
            batch = self.batch
            sampling = out.sampling_slots
            sync = not self.config.async_scheduling or (
                batch.num_needs_sync > 0 and batch.needs_sync[sampling].any()
            )
            rows = batch.has_grammar[sampling] if batch.num_grammar else None  # grammar rows
            grammar = rows is not None and rows.any()
            void = None  # rows whose request N-1's ids finished: their new ids are nobody's
            if (sync or grammar) and prev is not None:
                departures, generations = batch.departures, batch.generation[sampling]
                self.reader.read(prev)
                prev = None
                if batch.departures != departures:
                    void = batch.generation[sampling] != generations
            if len(sampling):
                if grammar and void is not None:
                    rows &= ~void  # ended by the read: their slots may be empty
                    grammar = rows.any()
                with self._range("sample"):
                    bitmask = None
                    if grammar:  # filled on the masks' worker while the device runs forward
                        masks = self.grammars.masks
                        occupants = batch.generation[sampling]  # whose rows these are
                        bitmask = masks.build(sampling, occupants, rows, batch.requests)
                    token_ids = self.sampler.sample(logits, sampling, self.runner.argmax, bitmask)
                mark = batch.launched(sampling, void)
                self.num_sampled += len(sampling)
                logprobs = None
                if sync:
                    sampled = self.sampler.read(logits, token_ids, sampling)
                    ids = np.array(sampled.token_ids, dtype=np.int64)
                    logprobs = sampled.logprobs
                else:
                    ids = self.runner.keep_sampled(token_ids)
                step = LaunchedStep(sampling, mark, ids, logprobs, pooled=pooled)
                if grammar:  # the worker has the matchers accept the ids as they land
                    step.grammar = masks.follow(
                        sampling, occupants, rows, ids if sync else token_ids
                    )
                if sync:
                    self.reader.read(step)
                else:
                    self.inflight = step
        if prev is not None:
            self.reader.read(prev)
        return self.take_outputs(deltas) if emit else []

    def take_outputs(self, deltas: TokenDeltas | None = None) -> list[RequestOutput]:
        """One RequestOutput per choice with news since it was last reported; with
        deltas, the news of a plain stream (ids only, no logprobs) that is neither its
        first output nor its last is added there instead (engine/outputs.py)."""
        if not self.news and not self.batch.num_plain:
            return []  # most steps of final-only requests
        with self._range("outputs"):
            outputs = take_outputs(self.news, deltas) if self.news else []
            self.news.clear()
            if self.batch.num_plain:  # after news: a first output comes before the rest
                outputs += take_plain(self.batch, deltas, self.config.stream_interval)
            return outputs
