"""Grammars: compile specs off the engine thread, one matcher per choice, the batch's mask.

The compiler is built once from the tokenizer. Compiled grammars are cached by
spec, and compiled by a thread pool: a request whose grammar is still compiling
is not admitted (the scheduler asks `GrammarState.ready`), and the rest of the
batch runs meanwhile. A spec seen before costs no compilation.

Each step with grammar rows, the host fills one token bitmask for the batch
(`fill`) while the device runs the forward, after the previous step's ids have
been accepted by the matchers (`accept`); the sampler applies it to the logits
before anything else (`BatchBitmask.apply`). EOS is in the mask only where the
grammar may end, and the only token there once it must: the request then ends on
EOS as usual (or, with ignore_eos, because its matcher accepted EOS).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import xgrammar as xgr

from engine.structured.spec import GrammarSpec, build_grammar

if TYPE_CHECKING:
    from engine.request import Request

logger = logging.getLogger("pagoda.engine")
CACHE_SIZE = 1024  # compiled grammars kept (least recently used dropped first)


class GrammarError(RuntimeError):
    """A grammar failed to compile in the engine; request_ids are the requests it ends
    (the server's engine loop fails exactly those)."""

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


class GrammarState:
    """One choice's grammar: compiling, then a matcher that follows its output."""

    def __init__(
        self,
        request_id: str,
        compiled: Future[xgr.CompiledGrammar],
        ended: list[tuple[Request, str]],
    ) -> None:
        self.request_id = request_id
        self.compiled = compiled
        self.matcher: xgr.GrammarMatcher | None = None
        self.ended = ended  # Grammars.ended: shared by every state

    def ready(self) -> bool:
        """Compiled (the scheduler admits the request only then)."""
        if self.matcher is None:
            if not self.compiled.done() or self.compiled.exception() is not None:
                return False
            # It ends by accepting EOS, which the mask allows only where the grammar
            # may end: the model chooses between ending and going on ("ab+" after "ab").
            self.matcher = xgr.GrammarMatcher(self.compiled.result())
        return True

    @property
    def failed(self) -> bool:
        return self.compiled.done() and self.compiled.exception() is not None

    def accept(self, token_id: int) -> str | None:
        """Advance by an id the request sampled: None, or the finish reason that ends it
        ("stop": the grammar is complete)."""
        matcher = self.matcher
        if not matcher.accept_token(token_id):
            # The mask allowed no other id. Only a grammar that no token can continue
            # gets here (every logit masked): end this request, not the batch.
            logger.error("%s: token %d is outside its grammar", self.request_id, token_id)
            return "abort"
        return "stop" if matcher.is_terminated() else None

    def accept_departed(self, req: Request, token_id: int) -> None:
        """accept, for an id read after req was preempted: the engine finishes it at its
        next step if that id ended it."""
        end = self.accept(token_id)
        if end is not None:
            self.ended.append((req, end))

    @property
    def live(self) -> bool:
        return self.matcher is not None and not self.matcher.is_terminated()


@dataclass
class BatchBitmask:
    """A step's allowed tokens, one packed row per sampling request (all ones where the
    request has no grammar)."""

    bits: torch.Tensor  # [num_requests, ceil(vocab / 32)] int32, on the logits' device

    def apply(self, logits: torch.Tensor) -> None:
        """Disallowed tokens' logits to -inf, in place: one kernel on the device."""
        xgr.apply_token_bitmask_inplace(logits, self.bits)


@dataclass
class CompileStats:
    num_compiled: int = 0  # specs compiled (cache misses)
    num_cache_hits: int = 0
    compile_s: float = 0.0  # cumulative seconds in the compiler
    last_compile_s: float = 0.0


class Grammars:
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: list[int],
        max_num_seqs: int,
        device: torch.device,
        max_threads: int | None = None,
    ) -> None:
        # Half the cores, at most 8: a row's mask is mostly a cached lookup (us), and
        # threads pay off only when many rows need tokens checked one by one.
        max_threads = max_threads or min(8, max(1, (os.cpu_count() or 2) // 2))
        # The tokenizer's own ids only: xgrammar counts the model's padding ids past
        # them as special tokens, and every accepted token scans that list.
        token_vocab = min(len(tokenizer), vocab_size)
        stops = [i for i in eos_token_ids if i < token_vocab]
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=token_vocab, stop_token_ids=stops or None
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="pagoda-grammar")
        self.cache: dict[GrammarSpec, Future[xgr.CompiledGrammar]] = {}
        self.stats = CompileStats()
        self.device = torch.device(device)
        self.batch_matcher = xgr.BatchGrammarMatcher(max_threads)
        # One pinned host buffer: it is refilled only once every earlier step's ids
        # have been read, and the device copied those after its last copy from here.
        shape = xgr.get_bitmask_shape(max_num_seqs, vocab_size)  # [rows, ceil(vocab / 32)]
        pin = self.device.type == "cuda"
        self.host = torch.full(shape, -1, dtype=torch.int32, pin_memory=pin)
        self.host_np = self.host.numpy()
        # xgrammar fills rows as wide as the tokenizer's vocabulary; past it the model's
        # padding ids stay masked in grammar rows (their bits beyond are 0 in the fill).
        self.words = xgr.get_bitmask_shape(1, token_vocab)[1]
        self.narrow = (
            torch.full((max_num_seqs, self.words), -1, dtype=torch.int32)
            if self.words < shape[1]
            else None
        )
        self.gpu = torch.full(shape, -1, dtype=torch.int32, device=self.device)
        if pin:  # Triton compiles the mask kernel at its first launch (one row, and more)
            for rows in (1, 2):
                BatchBitmask(self.gpu[:rows]).apply(
                    torch.zeros(rows, vocab_size, device=self.device)
                )
        self.waiting: list[GrammarState] = []  # compiling, by the engine's last look
        # Preempted requests whose grammar ended with an id read after they left the
        # batch, and how: the engine finishes them.
        self.ended: list[tuple[Request, str]] = []

    # -- requests ------------------------------------------------------------

    def state(self, request_id: str, spec: GrammarSpec) -> GrammarState:
        """A new choice's state; its grammar compiles in the pool unless cached."""
        compiled = self.cache.pop(spec, None)
        if compiled is None:
            compiled = self.pool.submit(self._compile, spec)
            if len(self.cache) >= CACHE_SIZE:
                del self.cache[next(iter(self.cache))]  # the least recently used
        else:
            self.stats.num_cache_hits += 1
        self.cache[spec] = compiled  # most recently used last
        state = GrammarState(request_id, compiled, self.ended)
        if not compiled.done() or state.failed:
            self.waiting.append(state)
        return state

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        start = time.perf_counter()
        compiled = self.compiler.compile_grammar(build_grammar(spec))
        elapsed = time.perf_counter() - start
        self.stats.num_compiled += 1
        self.stats.compile_s += elapsed
        self.stats.last_compile_s = elapsed
        return compiled

    def check_compiled(self, timeout: float = 0.0) -> None:
        """Forget compilations that have finished; raise GrammarError for failed ones
        (its requests end). timeout > 0: wait that long for one to finish (the engine
        has nothing else to do)."""
        if not self.waiting:
            return
        if timeout > 0:
            concurrent.futures.wait(
                {s.compiled for s in self.waiting},
                timeout,
                return_when=concurrent.futures.FIRST_COMPLETED,
            )
        failed = [s for s in self.waiting if s.failed]
        self.waiting = [s for s in self.waiting if not s.compiled.done()]
        if failed:  # a failed compilation is not cached: the next try recompiles
            bad = {s.compiled for s in failed}
            for spec in [k for k, v in self.cache.items() if v in bad]:
                del self.cache[spec]
            error = failed[0].compiled.exception()
            raise GrammarError(
                f"grammar compilation failed: {error}", sorted({s.request_id for s in failed})
            )

    # -- steps ---------------------------------------------------------------

    def fill(self, requests: Sequence) -> BatchBitmask | None:
        """The bitmask of a batch of sampling requests (None for a void row), on the
        device; None if no row has a live grammar. Requests must have accepted all their
        read ids."""
        rows: list[int] = []
        matchers: list[xgr.GrammarMatcher] = []
        for i, req in enumerate(requests):
            state = req.structured if req is not None else None  # None: a void row
            if state is not None and state.live and not req.is_finished:
                rows.append(i)
                matchers.append(state.matcher)
        if not rows:
            return None
        host = self.host
        num = len(requests)
        self.host_np[:num] = -1  # every token allowed in rows without a grammar
        if self.narrow is None:
            self.batch_matcher.batch_fill_next_token_bitmask(matchers, host, rows)
        else:
            self.batch_matcher.batch_fill_next_token_bitmask(matchers, self.narrow, rows)
            filled = np.array(rows)
            self.host_np[filled, : self.words] = self.narrow.numpy()[filled]
            self.host_np[filled, self.words :] = 0
        if self.device.type == "cpu":
            return BatchBitmask(host[:num])
        gpu = self.gpu[:num]
        gpu.copy_(host[:num], non_blocking=True)
        return BatchBitmask(gpu)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
