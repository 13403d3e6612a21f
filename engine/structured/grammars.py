"""Grammars: compile specs off the engine thread, one matcher per choice.

The compiler is built once from the tokenizer. Compiled grammars are cached by
spec, and compiled by a thread pool: a request whose grammar is still compiling
is not admitted (the scheduler asks `GrammarState.ready`), and the rest of the
batch runs meanwhile. A spec seen before costs no compilation.

The matchers follow every sampled id, and each step's token bitmask comes from
them (masks.py: filled on a worker while the device runs the forward, applied to
the logits before anything else). EOS is in the mask only where the grammar may
end, and the only token there once it must: the request then ends on EOS as usual
(or, with ignore_eos, because its matcher accepted EOS).
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import xgrammar as xgr

from engine.structured.masks import GrammarMasks
from engine.structured.spec import GrammarSpec, build_grammar

CACHE_SIZE = 1024  # compiled grammars kept (least recently used dropped first)


class GrammarError(RuntimeError):
    """A grammar failed to compile in the engine; request_ids are the requests it ends
    (the server's engine loop fails exactly those)."""

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


class GrammarState:
    """One choice's grammar: compiling, then a matcher that follows its output.

    Once running, its matcher is used by the masks' worker, which has each step's ids
    accepted and fills the next mask (masks.py)."""

    def __init__(self, request_id: str, compiled: Future[xgr.CompiledGrammar]) -> None:
        self.request_id = request_id
        self.compiled = compiled
        self.matcher: xgr.GrammarMatcher | None = None
        self.done = False  # the matcher ended (complete, or it refused an id)

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


@dataclass
class CompileStats:
    num_compiled: int = 0  # specs compiled (cache misses)
    num_cache_hits: int = 0
    last_compile_s: float = 0.0  # seconds in the compiler


class Grammars:
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: list[int],
        max_num_seqs: int,
        device: torch.device,
        max_threads: int | None = None,
        logits_dtype: torch.dtype = torch.float32,
        ids_out: torch.Tensor | None = None,  # GrammarMasks's
    ) -> None:
        # Half the cores, at most 8 (the compiler's, and the most a mask fill uses): a
        # row's mask is mostly a cached lookup, and threads pay off only for many rows.
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
        self.masks = GrammarMasks(
            token_vocab,
            vocab_size,
            max_num_seqs,
            device,
            max_threads,
            info.stop_token_ids,
            logits_dtype,
            ids_out,
        )
        self.waiting: list[GrammarState] = []  # compiling, by the engine's last look

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
        state = GrammarState(request_id, compiled)
        if not compiled.done() or state.failed:
            self.waiting.append(state)
        return state

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        start = time.perf_counter()
        compiled = self.compiler.compile_grammar(build_grammar(spec))
        self.stats.num_compiled += 1
        self.stats.last_compile_s = time.perf_counter() - start
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

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.masks.worker.close()
