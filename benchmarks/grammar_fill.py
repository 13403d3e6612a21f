"""The host's share of a structured decode step, without a model: accept and bitmask fill.

    python -m benchmarks.grammar_fill --out benchmarks/results/grammar-fill-cpu.json

For each model shape of benchmarks/structured.py (GPT-2 and Qwen2.5-0.5B: the same
synthetic tokenizer, built as benchmarks/checkpoints.py builds it, under a
50257- or 151936-wide logits row), `--batch` matchers of the "plain" schema's
grammar, compiled as the engine compiles it, walk random valid paths: each
step every row samples uniformly among the tokens its mask allows (EOS only
when nothing else is). Each step, on the same states, is timed:

- accept: the rows' ids accepted one `accept_token` call at a time, or by
  `BatchGrammarMatcher.batch_accept_token`, or as the engine does it:
  `GrammarMasks.follow` has its worker accept them and fill the next masks (its
  latency, handoff included), then `GrammarMasks.build` on the calling thread
  (the engine thread's share: the plan, the copy and the gather; on a CPU device,
  also a round trip to the worker); steps rotate;
- fill, by each strategy: xgrammar's BatchGrammarMatcher with N threads; one
  `fill_next_token_bitmask` call per row, serially or in k chunks on a
  persistent ThreadPoolExecutor (near k-fold faster only if xgrammar releases
  the GIL); and `GrammarMasks.build` with every row a first mask (its worker
  fills them all), until the worker is done;
- each row's own fill, with how many tokens its mask allows: the distribution
  says which grammar states are dear.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import xgrammar as xgr

from benchmarks.checkpoints import synthetic_tokenizer
from benchmarks.provenance import package_version, provenance, write_result
from benchmarks.shapes import CONFIGS
from benchmarks.structured import SCHEMAS
from engine.structured.grammars import Grammars, GrammarState
from engine.structured.spec import GrammarSpec

Fill = Callable[[list[xgr.GrammarMatcher], np.ndarray], None]


class _Row:
    """What GrammarMasks reads of a request: its grammar state, and whether it ended."""

    def __init__(self, state: GrammarState) -> None:
        self.structured = state
        self.is_finished = False


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def pool_fill(pool: ThreadPoolExecutor, chunks: int, narrow: torch.Tensor) -> Fill:
    """One fill_next_token_bitmask call per row, the rows in `chunks` parts on `pool`."""

    def run(matchers: list[xgr.GrammarMatcher], rows: np.ndarray) -> None:
        def part(k: int) -> None:
            for i in range(k, len(matchers), chunks):
                matchers[i].fill_next_token_bitmask(narrow, int(rows[i]))

        for f in [pool.submit(part, k) for k in range(chunks)]:
            f.result()

    return run


def strategies(grammars: Grammars, narrow: torch.Tensor, args) -> dict[str, Fill]:
    """Fill strategies by name; each fills the grammar rows of `narrow`."""
    out: dict[str, Fill] = {}
    for n in args.threads:
        batch = xgr.BatchGrammarMatcher(n)
        out[f"batch_threads_{n}"] = lambda ms, rows, b=batch: b.batch_fill_next_token_bitmask(
            ms, narrow, rows.tolist()
        )

    def serial(ms: list[xgr.GrammarMatcher], rows: np.ndarray) -> None:
        for m, r in zip(ms, rows.tolist()):
            m.fill_next_token_bitmask(narrow, r)

    out["serial"] = serial
    for k in args.pool:
        pool = ThreadPoolExecutor(k, thread_name_prefix=f"fill{k}")
        out[f"pool_threads_{k}"] = pool_fill(pool, k, narrow)
    return out


def allowed_ids(row: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def next_ids(
    matchers: list[xgr.GrammarMatcher], mask: np.ndarray, vocab: int, eos: int, rng
) -> list[int]:
    """Each row's next id, uniform among what its mask allows (EOS only if alone)."""
    ids = []
    for i in range(len(matchers)):
        allowed = allowed_ids(mask[i], vocab)
        choices = allowed[allowed != eos]
        ids.append(int(rng.choice(choices if len(choices) else allowed)))
    return ids


def summary(values_s: list[float]) -> dict:
    ms = sorted(1e3 * v for v in values_s)
    return {
        "median_ms": statistics.median(ms),
        "mean_ms": statistics.fmean(ms),
        "p10_ms": ms[len(ms) // 10],
        "p90_ms": ms[9 * len(ms) // 10],
    }


def run_model(name: str, args) -> dict:
    vocab_size = CONFIGS[name]().vocab_size
    tokenizer = synthetic_tokenizer(min(vocab_size, 50257))  # as build_checkpoint does
    eos = tokenizer.eos_token_id
    grammars = Grammars(tokenizer, vocab_size, [eos], args.batch, torch.device(args.device))
    compiled = grammars._compile(GrammarSpec.json_schema(SCHEMAS[args.schema]))
    token_vocab = min(len(tokenizer), vocab_size)
    words = xgr.get_bitmask_shape(1, token_vocab)[1]
    narrow = torch.full((args.batch, words), -1, dtype=torch.int32)
    mask = narrow.numpy()
    states = [GrammarState(f"r{i}", _done(compiled)) for i in range(args.batch)]
    for s in states:
        s.ready()
    matchers = [s.matcher for s in states]
    requests = [_Row(s) for s in states]
    rows = np.arange(args.batch)
    generations = np.zeros_like(rows)
    every = np.ones(args.batch, dtype=bool)  # rows with a grammar
    masks = grammars.masks
    fills = strategies(grammars, narrow, args)

    def build_all(ms: list[xgr.GrammarMatcher], slots: np.ndarray) -> None:
        masks.filled_generation[:] = -1  # every row: a first mask
        masks.build(slots, generations, every, requests)
        masks.worker.drain()  # the fill is the worker's: until it is done

    fills["masks_build"] = build_all
    rng = np.random.default_rng(args.seed)

    def advance(ids: list[int], how: str) -> tuple[float, float]:
        """Accept ids by `how`; seconds taken, and (engine) the build after."""
        built = 0.0
        start = time.perf_counter()
        if how == "batch_accept_token":
            ok = xgr.BatchGrammarMatcher.batch_accept_token(matchers, ids)
        elif how == "loop":
            ok = [m.accept_token(t) for m, t in zip(matchers, ids)]
        else:
            step_ids = np.array(ids)
            ended = masks.follow(rows, generations, every, step_ids).completed(step_ids)
            masks.worker.drain()  # the accept, then the worker's fill
            ok = [not ended]
        elapsed = time.perf_counter() - start
        if how == "engine":
            start = time.perf_counter()
            masks.build(rows, generations, every, requests)
            built = time.perf_counter() - start
        assert all(ok)
        masks.filled_generation[:] = -1  # the matchers moved
        for s in states:
            if s.matcher.is_terminated():
                s.matcher.reset()
                s.done = False
        return elapsed, built

    # Spread the rows over the grammar: each walks a random number of tokens first.
    starts = rng.integers(0, args.spread, args.batch)
    for t in range(args.spread):
        xgr.BatchGrammarMatcher(1).batch_fill_next_token_bitmask(matchers, narrow)
        ids = next_ids(matchers, mask, token_vocab, eos, rng)
        for i in np.flatnonzero(starts > t).tolist():
            assert matchers[i].accept_token(ids[i])
            if matchers[i].is_terminated():
                matchers[i].reset()

    times: dict[str, list[float]] = {key: [] for key in fills}
    accept_ways = ["loop", "batch_accept_token", "engine"]
    accept: dict[str, list[float]] = {key: [] for key in accept_ways}
    after_follow: list[float] = []
    row_us: list[float] = []
    row_allowed: list[int] = []
    order = list(fills)
    for step in range(args.warmup + args.steps):
        measured = step >= args.warmup
        order = order[1:] + order[:1]  # rotated, so no strategy always runs first
        for key in order:
            start = time.perf_counter()
            fills[key](matchers, rows)
            if measured:
                times[key].append(time.perf_counter() - start)
        for i, m in enumerate(matchers):  # each row alone, then the mask the walk uses
            start = time.perf_counter()
            m.fill_next_token_bitmask(narrow, i)
            if measured:
                row_us.append(1e6 * (time.perf_counter() - start))
                row_allowed.append(len(allowed_ids(mask[i], token_vocab)))
        ids = next_ids(matchers, mask, token_vocab, eos, rng)
        how = accept_ways[step % len(accept_ways)]
        elapsed, built = advance(ids, how)
        if measured:
            accept[how].append(elapsed)
            if how == "engine":
                after_follow.append(built)

    row_us_np, allowed_np = np.array(row_us), np.array(row_allowed)
    by_allowed = {}
    for lo, hi in ((0, 100), (100, 1000), (1000, 10000), (10000, token_vocab + 1)):
        sel = (allowed_np >= lo) & (allowed_np < hi)
        if sel.any():
            by_allowed[f"{lo}-{hi - 1}"] = {
                "fraction_of_rows": float(sel.mean()),
                "median_us": float(np.median(row_us_np[sel])),
                "p90_us": float(np.percentile(row_us_np[sel], 90)),
                "share_of_fill_time": float(row_us_np[sel].sum() / row_us_np.sum()),
            }
    return {
        "model": name,
        "logits_vocab": vocab_size,
        "tokenizer_vocab": token_vocab,
        "bitmask_words": {"tokenizer": words, "logits": masks.width},
        # engine: the masks' accept, then the worker's fill until it is done
        "accept_ms_per_step": {k: summary(v) for k, v in accept.items()},
        "build_after_follow_ms_per_step": summary(after_follow),
        "fill_ms_per_step": {k: summary(v) for k, v in times.items()},
        "row_fill_us": {
            "median": float(np.median(row_us_np)),
            "p90": float(np.percentile(row_us_np, 90)),
            "p99": float(np.percentile(row_us_np, 99)),
            "max": float(row_us_np.max()),
            "by_allowed_tokens": by_allowed,
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", nargs="+", default=["gpt2", "qwen2-0.5b"])
    p.add_argument("--schema", choices=sorted(SCHEMAS), default="plain")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=200, help="timed steps")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--spread", type=int, default=200, help="at most this many tokens first")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--pool", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where GrammarMasks puts the mask (its copy and gather)",
    )
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    # Torch's CPU ops (the mask's gather on a CPU device) would leave OpenMP threads
    # spinning on the cores the fill threads want.
    torch.set_num_threads(1)
    result = {
        **provenance("grammar_fill", argv),
        "cpus": os.cpu_count(),
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device != "cpu" else None,
        "xgrammar": package_version("xgrammar"),
        "batch": args.batch,
        "schema": args.schema,
        "models": [run_model(name, args) for name in args.models],
    }
    print(json.dumps(result, indent=2))
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
