"""The host's per-step cost of structured outputs, on the CPU: GrammarMasks without a model.

    python -m benchmarks.structured_host --out benchmarks/results/structured-host-cpu.json
    python -m benchmarks.structured_host --before-tree /tmp/old --fill-threads 1 2 --out X.json

The second runs this tree and another in turn (`--pairs` runs each; each in its
own process), e.g. a commit's files: `git archive C | tar -x -C /tmp/old; echo C >
/tmp/old/COMMIT; cp benchmarks/structured_host.py /tmp/old/benchmarks/`.

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
- worker GIL: the CPU time of the thread running those jobs (the worker) less its
  CPU time inside the xgrammar calls that release the GIL (accepts and fills): what
  it runs holding it, which the engine thread waits out whenever it wants the GIL
  meanwhile.
  Measured over steps of their own after the others: the timing of each call
  costs time itself.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import torch
import xgrammar as xgr

from benchmarks.checkpoints import synthetic_tokenizer
from benchmarks.provenance import git_commit, package_version, write_result
from benchmarks.structured import SCHEMAS
from engine.structured import masks as masks_module
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


class _PythonClock:
    """CPU time of the thread running GrammarMasks' jobs (the worker), less its CPU time
    inside the xgrammar calls that release the GIL: what it runs holding it."""

    RELEASING = [
        (xgr.BatchGrammarMatcher, "batch_fill_next_token_bitmask"),
        (xgr.GrammarMatcher, "accept_token"),
        (xgr.GrammarMatcher, "is_terminated"),
        (masks_module, "accept_all"),
    ]

    def __init__(self, masks) -> None:
        self.lock = threading.Lock()
        self.local = threading.local()
        self.held = 0.0
        for name in ("_follow", "_prepare"):
            if hasattr(masks, name):
                setattr(masks, name, self._job(getattr(masks, name)))
        for owner, name in self.RELEASING:
            if hasattr(owner, name):
                setattr(owner, name, self._releasing(getattr(owner, name)))

    def _state(self):
        local = self.local
        if not hasattr(local, "depth"):
            local.depth, local.released = 0, 0.0
        return local

    def _job(self, method):
        def run(*args):
            local = self._state()
            local.depth += 1
            start, released = time.thread_time(), local.released
            try:
                return method(*args)
            finally:
                local.depth -= 1
                if not local.depth:  # the outermost job on this thread
                    spent = time.thread_time() - start - (local.released - released)
                    with self.lock:
                        self.held += spent

        return run

    def _releasing(self, function):
        def run(*args, **kwargs):
            local = self._state()
            start = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                local.released += time.thread_time() - start

        return run

    def take(self) -> float:
        with self.lock:
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


def run(args, threads: int) -> dict:
    tokenizer = synthetic_tokenizer(GPT2_VOCAB)
    eos = tokenizer.eos_token_id
    grammars = Grammars(tokenizer, GPT2_VOCAB, [eos], args.batch, torch.device("meta"), threads)
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

    # --before runs this script on an older tree, whose follow took the batch's requests.
    follow_extra = (by_slot,) if "by_slot" in inspect.signature(masks.follow).parameters else ()
    ended_rows = 0

    def step() -> tuple[float, float, float]:
        """One step; the engine thread's seconds in build and follow, and the worker's
        window."""
        nonlocal ended_rows
        start = time.perf_counter()
        masks.build(slots, generations, grammar, by_slot)
        built = time.perf_counter() - start
        masks.drain()  # the device's wait: the masks are in (the worker's job counts)
        ids = pick_ids()
        start = time.perf_counter()
        ended = masks.follow(ids, slots, generations, grammar, *follow_extra)
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
        return built, followed, window

    # The times first, then (the clock's wrappers cost time themselves) the GIL's.
    build_s, follow_s, wall_s = [], [], []
    for i in range(args.warmup + args.steps):
        built, followed, window = step()
        if i >= args.warmup:
            build_s.append(built)
            follow_s.append(followed)
            wall_s.append(window)
    clock = _PythonClock(masks)
    gil_s = []
    for _ in range(args.steps):
        step()
        gil_s.append(clock.take())
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


def medians(runs: list[dict]) -> dict:
    """Per figure, the median over runs of their medians."""
    first = runs[0]
    if "median_us" in first:
        return {"median_us": round(statistics.median(r["median_us"] for r in runs), 1)}
    return {k: medians([r[k] for r in runs]) for k, v in first.items() if isinstance(v, dict)}


def ab(args) -> dict:
    """This tree and --before-tree in turn, `--pairs` times per fill-thread count, each
    run in its own process (so each imports its own tree)."""
    trees = {"before": args.before_tree.resolve(), "after": Path.cwd()}
    out: dict = {"before_commit": _tree_commit(trees["before"]), "by_fill_threads": {}}
    for threads in args.fill_threads:
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for _ in range(args.pairs):
            for name, root in trees.items():
                command = [sys.executable, "-m", "benchmarks.structured_host"]
                command += ["--fill-threads", str(threads), "--steps", str(args.steps)]
                command += ["--warmup", str(args.warmup), "--batch", str(args.batch)]
                command += ["--schema", args.schema, "--seed", str(args.seed)]
                env = dict(os.environ, PYTHONPATH=str(root))
                done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
                if done.returncode:
                    raise RuntimeError(f"{name} tree failed:\n{done.stderr}")
                runs[name].append(json.loads(done.stdout)["run"])
        out["by_fill_threads"][str(threads)] = {
            name: {"median_of_runs": medians(r), "runs": r} for name, r in runs.items()
        }
    return out


def _tree_commit(root: Path) -> str | None:
    """The commit a tree without .git was taken from, as --before-tree's COMMIT file
    says."""
    marker = root / "COMMIT"
    return marker.read_text().strip() if marker.exists() else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--schema", choices=sorted(SCHEMAS), default="plain")
    p.add_argument("--steps", type=int, default=400, help="timed steps (and as many for the GIL)")
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument(
        "--fill-threads", type=int, nargs="+", default=[1], help="the mask fill's threads"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--before-tree",
        type=Path,
        default=None,
        help="another tree's root (a COMMIT file in it names its commit): run both in turn",
    )
    p.add_argument("--pairs", type=int, default=3, help="with --before-tree: runs of each")
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
        "xgrammar": package_version("xgrammar"),
        "batch": args.batch,
        "vocab": GPT2_VOCAB,
        "schema": args.schema,
    }
    if args.before_tree is not None:
        result |= ab(args)
    else:
        (threads,) = args.fill_threads
        result |= {"fill_threads": threads, "run": run(args, threads)}
    print(json.dumps(result, indent=2))
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
