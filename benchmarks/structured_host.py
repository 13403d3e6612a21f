"""The host's per-step cost of structured outputs, on the CPU: GrammarMasks without a model.

    python -m benchmarks.structured_host --out benchmarks/results/structured-host-cpu.json
    python -m benchmarks.structured_host --before OLD.json --out NEW.json  # A/B

`--batch` rows of GPT-2's vocabulary (the synthetic 50257-token tokenizer
benchmarks/checkpoints.py builds), all under the "plain" schema of
benchmarks/structured.py, walk random valid paths (each step every row picks
uniformly among the tokens its mask allows, EOS only when nothing else is; a
row whose grammar ends is taken by a new request). Each step drives
`GrammarMasks` in the engine's order, as on a CUDA device with a device-side
wait: `build` (the engine thread plans the step's mask and queues its copy), the
ids, then `follow` (the engine thread hands them to the worker). The masks'
device is `meta`, so the copy and gather the engine thread queues cost their
dispatch but move no data, as on a GPU, where they are launches. Timed per step:

- engine: the engine thread's time in `follow` and in `build` (the worker idle);
- worker wall: from `follow` returning until the worker's jobs are done (accept
  the ids, fill the next masks), the engine thread blocked meanwhile;
- worker GIL: the worker thread's CPU time in those jobs (and in the one
  `build` hands it, if any) less its CPU time inside xgrammar's mask fill, which
  runs without the GIL: what the worker runs holding it, which the engine thread
  waits out whenever it wants the GIL meanwhile (the other xgrammar calls' C++
  work is counted in: an upper bound).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import torch
import xgrammar as xgr

from benchmarks.checkpoints import synthetic_tokenizer
from benchmarks.provenance import git_commit, write_result
from benchmarks.structured import SCHEMAS
from engine.structured.grammars import Grammars, GrammarState
from engine.structured.spec import GrammarSpec

GPT2_VOCAB = 50257


class _Request:
    """What GrammarMasks reads of a request: its grammar state."""

    def __init__(self, state: GrammarState) -> None:
        self.structured = state
        self.is_finished = False


class _DeviceWait:
    """A device flag whose waits cost nothing: the engine thread never waits for the
    worker, as on CUDA."""

    def set(self, n: int) -> None:
        pass

    def wait(self, n: int) -> None:
        pass


class _WorkerClock:
    """The worker thread's CPU time in GrammarMasks' jobs, less its CPU time inside the
    mask fill (xgrammar's C++, which releases the GIL): what it runs holding the GIL,
    give or take the C++ of the other xgrammar calls (counted in)."""

    def __init__(self, masks) -> None:
        self.held = 0.0
        self.in_fill = 0.0
        for name in ("_follow", "_prepare"):
            setattr(masks, name, self._job(getattr(masks, name)))
        fill = xgr.BatchGrammarMatcher.batch_fill_next_token_bitmask

        def timed_fill(batch, *args, **kwargs):
            start = time.thread_time()
            try:
                return fill(batch, *args, **kwargs)
            finally:
                self.in_fill += time.thread_time() - start

        xgr.BatchGrammarMatcher.batch_fill_next_token_bitmask = timed_fill

    def _job(self, method):
        def run(*args):
            start, fill = time.thread_time(), self.in_fill
            try:
                return method(*args)
            finally:
                self.held += time.thread_time() - start - (self.in_fill - fill)

        return run

    def take(self) -> float:
        held, self.held = self.held, 0.0
        return held


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def summary(values_s: list[float]) -> dict:
    us = sorted(1e6 * v for v in values_s)
    return {
        "median_us": round(statistics.median(us), 1),
        "mean_us": round(statistics.fmean(us), 1),
        "p10_us": round(us[len(us) // 10], 1),
        "p90_us": round(us[9 * len(us) // 10], 1),
    }


def run(args) -> dict:
    tokenizer = synthetic_tokenizer(GPT2_VOCAB)
    eos = tokenizer.eos_token_id
    grammars = Grammars(
        tokenizer, GPT2_VOCAB, [eos], args.batch, torch.device("meta"), args.fill_threads
    )
    compiled = grammars._compile(GrammarSpec.json_schema(SCHEMAS[args.schema]))
    masks = grammars.masks
    masks.flag = _DeviceWait()
    vocab = min(len(tokenizer), GPT2_VOCAB)
    host = masks.host_np
    rng = np.random.default_rng(args.seed)

    def new_request(slot: int) -> _Request:
        state = GrammarState(f"r{slot}", _done(compiled))
        state.ready()
        return _Request(state)

    by_slot: list[_Request | None] = [new_request(s) for s in range(args.batch)]
    slots = np.arange(args.batch, dtype=np.int64)
    generations = np.zeros(args.batch, dtype=np.int64)
    grammar = np.ones(args.batch, dtype=bool)

    def pick_ids() -> np.ndarray:
        """Each row's next id, uniform among what its host row allows (EOS only if alone)."""
        bits = np.unpackbits(host[: args.batch].view(np.uint8), axis=1, bitorder="little")
        ids = np.empty(args.batch, dtype=np.int64)
        for i in range(args.batch):
            allowed = np.flatnonzero(bits[i, :vocab])
            choices = allowed[allowed != eos]
            ids[i] = rng.choice(choices if len(choices) else allowed)
        return ids

    clock = _WorkerClock(masks)
    follow_s, build_s, wall_s, gil_s = [], [], [], []
    ended_rows = 0
    for step in range(args.warmup + args.steps):
        measured = step >= args.warmup
        start = time.perf_counter()
        masks.build(slots, generations, grammar, by_slot)
        built = time.perf_counter() - start
        masks.drain()  # the device's wait: the masks are in (the worker's job counts)
        ids = pick_ids()
        start = time.perf_counter()
        ended = masks.follow(ids, slots, generations, grammar)
        followed = time.perf_counter() - start
        start = time.perf_counter()
        ended_requests = ended.result()
        masks.drain()
        window = time.perf_counter() - start
        for req, _reason in ended_requests:  # leaves; a new request takes its slot
            slot = by_slot.index(req)
            generations[slot] += 1
            by_slot[slot] = new_request(slot)
            ended_rows += 1
        if measured:
            follow_s.append(followed)
            build_s.append(built)
            wall_s.append(window)
            gil_s.append(clock.take())
        else:
            clock.take()
    engine_s = [f + b for f, b in zip(follow_s, build_s)]
    return {
        "engine_us_per_step": {
            "follow_and_build": summary(engine_s),
            "follow": summary(follow_s),
            "build": summary(build_s),
        },
        "worker_wall_us_per_step": summary(wall_s),
        "worker_gil_us_per_step": summary(gil_s),
        "grammars_ended": ended_rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--schema", choices=sorted(SCHEMAS), default="plain")
    p.add_argument("--steps", type=int, default=400, help="timed steps")
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--fill-threads", type=int, default=1, help="the mask fill's threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--before", type=Path, default=None, help="a result to put beside this one")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    result = {
        "benchmark": "structured_host",
        "command": "python -m benchmarks.structured_host "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "commit": git_commit(),
        "cpus": os.cpu_count(),
        "xgrammar": _version("xgrammar"),
        "batch": args.batch,
        "vocab": GPT2_VOCAB,
        "schema": args.schema,
        "fill_threads": args.fill_threads,
        "run": run(args),
    }
    if args.before is not None:
        before = json.loads(args.before.read_text())
        result["before"] = {k: before[k] for k in ("command", "date", "commit", "run")}
    print(json.dumps(result, indent=2))
    write_result(args.out, result)
    return 0


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
