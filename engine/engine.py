"""The engine: add requests, step, read deltas. Single-threaded by design.

step(): schedule → launch the forward and the sampler → while the GPU runs,
read the previous step's ids, append them, apply stops, detokenize and build
the RequestOutputs. The server drives it from one background thread. In the
scheduler's steady state, final-only requests skip the per-request part: their
ids are booked as numpy rows and appended when the state ends (engine.quiet_run).

Outputs are built when asked for, not per token: a step notes which requests
have news, and `step(emit=True)` or `take_outputs()` turns all of it into one
RequestOutput per choice. A consumer that falls behind (the server's event
loop under load) asks less often and gets fewer, larger deltas, so the cost
of detokenizing and building outputs follows its pace, not the token rate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.cuda.nvtx import range_pop, range_push

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache import BlockManager
from engine.model_runner import ModelRunner, SampledIds
from engine.models.demo import DEMO_MODEL_NAME, ensure_demo_model
from engine.models.loader import (
    checkpoint_dtype,
    load_config,
    load_model,
    load_tokenizer,
    max_model_len,
)
from engine.quiet_run import QuietRun, stop_table
from engine.request import (
    Request,
    RequestOutput,
    RequestStatus,
    TokenDeltas,
    TokenLogprob,
    out_of_vocab,
)
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.structured.grammars import Grammars


@dataclass
class LaunchedStep:
    """A step on its way: what ran, which of it sampled, and the sampled ids (a host
    list, or a handle whose tolist() waits for the device's copy)."""

    batch: SchedulerOutput
    sampling: list[Request]
    token_ids: list[int] | SampledIds | None  # None: no request sampled
    logprobs: list[TokenLogprob | None] | None = None
    run: QuietRun | None = None  # its ids are booked by this run (if it is still on)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks in use
    num_preemptions: int  # cumulative
    prefix_cache_queries: int  # cumulative tokens looked up
    prefix_cache_hits: int  # cumulative tokens found


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_dir = config.model or ensure_demo_model()
        self.model_dir = model_dir
        self.model_name = Path(model_dir).name if config.model else DEMO_MODEL_NAME
        hf_config = load_config(model_dir)
        limit = max_model_len(hf_config)
        if config.max_model_len is None:
            config.max_model_len = limit
        elif config.max_model_len > limit:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's limit of {limit} tokens"
            )
        device = config.torch_device
        dtype = config.torch_dtype(checkpoint_dtype(hf_config))
        self.model, _ = load_model(model_dir, device, dtype, hf_config)
        self.tokenizer = load_tokenizer(model_dir)
        self.vocab_size = hf_config.vocab_size
        self.eos_token_ids = _eos_token_ids(hf_config, self.tokenizer)
        self.eos_set = frozenset(self.eos_token_ids)

        self.runner = ModelRunner(config, self.model, hf_config)
        self.blocks = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        if device.type == "cuda":  # hash filled blocks while the host waits for the GPU
            self.blocks.defer_hashing = True
            self.runner.idle_work = self.blocks.hash_unhashed
        self.scheduler = Scheduler(config, self.blocks)
        self.sampler = Sampler(self.vocab_size, device, config.seed, self.eos_token_ids)
        self.requests: dict[str, list[Request]] = {}  # client id -> its n choices
        self.inflight: LaunchedStep | None = None  # launched; its ids not read yet
        self.news: dict[Request, None] = {}  # requests with output not taken yet (ordered)
        self.num_sampled = 0  # sampled rows, cumulative (void ones included)
        # (sampling list, must it sync, can its steps be a quiet run, has it grammars),
        # for the last list.
        self.sampling_for: tuple[list[Request] | None, bool, bool, bool] = (
            None,
            False,
            False,
            False,
        )
        self._grammars: Grammars | None = None  # built with the first structured request
        self.run: QuietRun | None = None  # see engine.quiet_run
        self.scheduler.on_leave_steady = self._settle
        # NVTX ranges around the step's phases, for nsys. Checked inline: entering a
        # null context manager per phase costs more than the check, every step.
        self.nvtx = config.nvtx and device.type == "cuda"

    # -- requests ---------------------------------------------------------

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Reject what can never run, before any work is done. Pure: safe from any thread."""
        check_request(prompt_token_ids, params, self.config.max_model_len, self.vocab_size)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_request(prompt_token_ids, params)
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
            eos = frozenset() if choice_params.ignore_eos else self.eos_set
            req.stop_ids = eos | frozenset(choice_params.stop_token_ids)
            if params.grammar is not None:  # [structured] a matcher per choice
                req.structured = self.grammars.state(request_id, params.grammar)
            choices.append(req)
            self.scheduler.add(req)
        self.requests[request_id] = choices

    def abort_request(self, request_id: str) -> None:
        for req in self.requests.pop(request_id, []):
            self.news.pop(req, None)  # nobody is waiting for it any more
            if not req.is_finished:
                self.scheduler.finish(req, "abort")
        if self.inflight is not None and all(
            req.is_finished for req in self.inflight.batch.requests
        ):
            self.inflight = None  # nothing left to read: its device work is simply void

    @property
    def grammars(self) -> Grammars:
        """Structured outputs' compiler and matchers (its tokenizer info takes a while)."""
        if self._grammars is None:
            self._grammars = Grammars(
                self.tokenizer,
                self.vocab_size,
                self.eos_token_ids,
                self.config.max_num_seqs,
                self.config.torch_device,
            )
        return self._grammars

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self.inflight is not None

    def get_stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.blocks.usage,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.blocks.prefix_queries,
            prefix_cache_hits=self.blocks.prefix_hits,
        )

    # -- the loop ---------------------------------------------------------

    def step(self, emit: bool = True, deltas: TokenDeltas | None = None) -> list[RequestOutput]:
        """Run one step; return the news it brings (mostly the previous step's tokens).

        emit=False keeps the news for a later step or take_outputs(), which then
        report it together. With deltas, the outputs of plain streams between
        their first and last go there instead (see take_outputs).

        The host runs one step ahead of the device: it schedules and launches
        step N (whose decodes read step N-1's sampled ids on the device), and
        only then reads N-1's ids, appends them, matches stops and builds
        outputs, while the GPU runs N. A request that stopped at N-1 wastes its
        row in N; its token there is void. Penalties and logprobs need the ids
        on the host, so a step with such a request reads N-1 before sampling
        and its own ids at once.
        """
        nvtx = self.nvtx
        if self._grammars is not None and self._grammars.waiting:
            # [structured] Raise for grammars that failed to compile; with nothing to
            # run, wait a little for one to finish instead of spinning.
            idle = not self.scheduler.running and self.inflight is None
            self._grammars.check_compiled(0.01 if idle else 0.0)
        if nvtx:
            range_push("schedule")
        batch = self.scheduler.schedule()  # leaving the steady state settles the run
        if nvtx:
            range_pop()
        prev, self.inflight = self.inflight, None
        if batch:
            # The last step sampled this very list, and its ids are still unread: every
            # input is on the device, and no request's count needs to be looked at.
            on_device = prev is not None and prev.sampling is batch.requests
            assert self.run is None or on_device  # a run lasts as long as the steady state
            if nvtx:
                range_push("forward")
            logits = self.runner.execute(batch, on_device)
            if nvtx:
                range_pop()
            sampling = batch.sampling()
            if sampling is not self.sampling_for[0]:  # the steady state repeats one list
                params = [req.params for req in sampling]  # lists: faster than generators
                sync = not self.config.async_scheduling or any([p.needs_sync for p in params])
                # A quiet run books ids without counting them: min_tokens' mask reads
                # the count every step.
                quiet = all([p.quiet and not p.min_tokens for p in params])
                grammar = any([p.grammar is not None for p in params])
                self.sampling_for = (sampling, sync, quiet, grammar)
            _, sync, quiet, grammar = self.sampling_for
            # [structured] A grammar's mask needs every id before this step's accepted.
            if (sync or grammar) and prev is not None:
                self._process(prev)
                prev = None
            token_ids = None
            run = None
            if sampling:
                if nvtx:
                    range_push("sample")
                # [structured] Filled while the device runs the forward.
                bitmask = self._grammars.fill(sampling) if grammar else None
                # logits: the sampling rows only
                token_ids = self.sampler.sample(logits, sampling, self.runner.argmax, bitmask)
                if nvtx:
                    range_pop()
                if quiet and batch.steady and on_device and not sync:
                    if self.run is None:
                        self.run = QuietRun(sampling, stop_table(sampling, self.vocab_size))
                    run = self.run
                    run.unread += 1
                else:
                    for req in sampling:
                        req.num_inflight += 1
                self.num_sampled += len(sampling)
            if not sync:
                ids = self.runner.keep_sampled(token_ids) if sampling else None
                self.inflight = LaunchedStep(batch, sampling, ids, run=run)
            elif sampling:
                sampled = self.sampler.read(logits, token_ids, sampling)
                self._process(LaunchedStep(batch, sampling, sampled.token_ids, sampled.logprobs))
            else:  # prefill chunks only: nothing to read, blocks to register
                self._process(LaunchedStep(batch, sampling, None))
        if prev is not None:
            self._process(prev)
        return self.take_outputs(deltas) if emit else []

    def take_outputs(self, deltas: TokenDeltas | None = None) -> list[RequestOutput]:
        """One RequestOutput per choice with news since it was last reported; with
        deltas, the news of a plain stream (ids only, no logprobs) that is neither its
        first output nor its last is added there instead."""
        if not self.news:
            return []  # most steps of final-only requests
        with self._nvtx("outputs"):
            news, self.news = self.news, {}
            if deltas is None:
                outputs = [self._output(req) for req in news]
                return [out for out in outputs if out is not None]
            # Bound appends: this loop runs for every streamed choice of every report.
            add_id, add_index = deltas.request_ids.append, deltas.indices.append
            add_count, token_ids = deltas.num_tokens.append, deltas.token_ids
            finished = RequestStatus.FINISHED
            outputs = []
            for req in news:
                emitted = req.num_emitted_tokens
                if req.params.plain and emitted and req.status is not finished:
                    out_ids = req.output_token_ids
                    req.num_emitted_tokens = len(out_ids)
                    add_id(req.request_id)
                    add_index(req.index)
                    add_count(len(out_ids) - emitted)
                    token_ids += out_ids[emitted:]
                else:
                    out = self._output(req)
                    if out is not None:
                        outputs.append(out)
            return outputs

    def _process(self, step: LaunchedStep) -> None:
        """Read a launched step's ids; append them, apply stops, note the news."""
        if self.nvtx:
            with torch.cuda.nvtx.range("update"):
                self._update(step)
        else:
            self._update(step)

    def _update(self, step: LaunchedStep) -> None:
        """_process without its NVTX range."""
        token_ids = step.token_ids
        if step.run is not None and step.run is self.run:
            if self.run.read(token_ids.numpy()):  # waits for the step's copy
                return
            self._settle()  # a stop id: this step is read as an ordinary one
        if token_ids is not None and not isinstance(token_ids, list):
            token_ids = token_ids.tolist()  # waits for the step's copy to the host
        if not step.sampling:
            return  # prefill chunks only: the scheduler registers their full blocks
        if step.logprobs is not None:  # before any request can finish: its last output has them
            for req, logprob in zip(step.sampling, step.logprobs):
                if logprob is not None and req.status is not RequestStatus.FINISHED:
                    req.pending_logprobs.append(logprob)
        caching = self.blocks.enable_prefix_caching
        every_step = self.config.stream_interval == 1
        interval = self.config.stream_interval
        now = time.time()
        news = self.news
        finished = RequestStatus.FINISHED
        # The hot loop (every sampling request, every step): as few operations as
        # the common case allows. Full blocks are registered for the prefix cache
        # here only at the first token (a sibling choice waits for the prompt's
        # blocks); later ones when the scheduler opens the next block, and when
        # the blocks are freed.
        for req, token_id in zip(step.sampling, token_ids):
            req.num_inflight -= 1
            if req.status is finished:
                continue  # stopped or aborted while this step ran: its work is void
            out_ids = req.output_token_ids
            if not out_ids:
                req.metrics.first_token_time = now
                if caching:
                    self.blocks.cache_full_blocks(req)
            all_ids = req.all_token_ids
            out_ids.append(token_id)
            all_ids.append(token_id)
            params = req.params
            if token_id in req.stop_ids or len(all_ids) >= req.max_num_tokens:
                self._check_token_stop(req, token_id)
            elif req.structured is not None and (end := req.structured.accept(token_id)):
                self._finish(req, end)  # [structured] the grammar is complete
            elif params.quiet:
                continue  # the common offline case: nothing to report yet
            elif every_step and params.streams_ids:
                news[req] = None  # the common served case: news every step
                continue
            if params.stop:
                self._detokenize(req)  # a stop string must end it now, not when asked
            # Streamed: every `interval` tokens, the first at once. Always: the last.
            streams = not params.final_only and (
                interval == 1
                or not req.num_emitted_tokens
                or len(out_ids) - req.num_emitted_tokens >= interval
            )
            if streams or req.status is finished:
                news[req] = None

    def _settle(self) -> None:
        """End the quiet run: append the ids it booked, and count its unread steps in
        flight (they are read as ordinary steps)."""
        run, self.run = self.run, None
        if run is None:
            return
        run.append()
        if run.unread:
            for req in run.requests:
                req.num_inflight += run.unread
        if self.blocks.enable_prefix_caching:  # blocks filled during the run
            for req in run.requests:
                self.blocks.cache_full_blocks(req)

    def _check_token_stop(self, req: Request, token_id: int) -> None:
        """req just sampled token_id, one of its stop ids, or reached its length limit."""
        params = req.params
        past_min = len(req.output_token_ids) >= params.min_tokens
        if past_min and not params.ignore_eos and token_id in self.eos_set:
            self._finish(req, "stop")
        elif past_min and token_id in params.stop_token_ids:
            self._finish(req, "stop", token_id)
        elif len(req.all_token_ids) >= req.max_num_tokens:
            self._finish(req, "length")

    def _finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        self.scheduler.finish(req, reason, stop_reason)
        siblings = self.requests.get(req.request_id, [])
        if all(r.is_finished for r in siblings):
            self.requests.pop(req.request_id, None)

    def _detokenize(self, req: Request) -> None:
        """Decode what req gained since last time; finish it at a stop string."""
        out_ids = req.output_token_ids
        if req.num_detokenized_tokens == len(out_ids):
            return
        new_ids = out_ids[req.num_detokenized_tokens :]
        req.num_detokenized_tokens = len(out_ids)
        params = req.params
        if params.final_only and not params.stop:
            req.detokenizer.decode_all(new_ids)  # seen once, when finished: one call
            return
        stop_string = req.detokenizer.update(new_ids)
        if stop_string is not None:
            if req.is_finished:  # a token-level stop came first, but the text stops earlier
                req.finish_reason, req.stop_reason = "stop", stop_string
            else:
                self._finish(req, "stop", stop_string)

    def _output(self, req: Request) -> RequestOutput | None:
        """The news since req's last output (None: a final-only request still running).

        Runs for every streamed choice on every step that reports: attributes are
        read once, and the output is built positionally."""
        params = req.params
        if params.detokenize:
            self._detokenize(req)
        finished = req.status is RequestStatus.FINISHED
        if params.final_only and not finished:
            return None
        out_ids = req.output_token_ids
        emitted = req.num_emitted_tokens
        req.num_emitted_tokens = len(out_ids)
        logprobs: list[TokenLogprob] | None = None
        if params.logprobs is not None:
            logprobs, req.pending_logprobs = req.pending_logprobs, []
        return RequestOutput(
            req.request_id,
            req.index,
            out_ids[emitted:],
            req.detokenizer.get_delta(finished) if params.detokenize else "",
            logprobs,
            finished,
            req.finish_reason,
            req.stop_reason,
            len(req.prompt_token_ids),
            len(out_ids),
            req.num_cached_tokens,
            req.metrics if emitted == 0 or finished else None,
        )

    def _nvtx(self, name: str):
        return torch.cuda.nvtx.range(name) if self.nvtx else contextlib.nullcontext()


def check_request(
    prompt_token_ids: list[int], params: SamplingParams, max_len: int, vocab_size: int
) -> None:
    """Raise ValueError for a request that can never run (any thread, any process)."""
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        raise ValueError("the prompt is empty")
    bad = out_of_vocab(prompt_token_ids, vocab_size)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is outside the vocabulary (size {vocab_size})")
    params.check_vocab(vocab_size)
    if num_prompt >= max_len:
        raise ValueError(
            f"the prompt has {num_prompt} tokens, but max_model_len is {max_len}: "
            "no room to generate (shorten the prompt)"
        )
    if params.max_tokens is not None and num_prompt + params.max_tokens > max_len:
        raise ValueError(
            f"the prompt ({num_prompt} tokens) plus max_tokens ({params.max_tokens}) is "
            f"{num_prompt + params.max_tokens} tokens, more than max_model_len ({max_len})"
        )


def _eos_token_ids(hf_config, tokenizer) -> list[int]:
    ids = getattr(hf_config, "eos_token_id", None)
    ids = ids if isinstance(ids, list) else [ids]
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted({i for i in ids if i is not None})
