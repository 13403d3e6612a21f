"""Time to first token with the steps that hold prompts replaying prefill graphs, against
the same engine running those steps eagerly (its graphs' token table emptied), the two
alternating in one process: a lone prompt by length, and one joining `--beside`
sequences already decoding (each of its steps then carries their decode rows too).

    python -m benchmarks.prompt_graphs --model qwen3.5-27b --lengths 2 16 64 256 500 \
        --beside 16 --out benchmarks/results/prompt-graphs-qwen3.5-27b-h200.json

Meant for models with recurrent layers, whose prompt steps replay graphs only up to
ModelRunner.graph_limit tokens (their prompts walk, kernels in one launch a layer, up to
walk_limit); any model runs. A length past the graphs' buckets runs eagerly both ways. Medians of
`--repeats`, in ms from `add_request` to the step that brings the first token.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.checkpoints import model_dir as checkpoint_dir
from benchmarks.provenance import provenance, write_result
from engine import LLM, SamplingParams
from engine.engine import Engine

_ids = itertools.count()


def first_token_ms(engine: Engine, prompt: list[int]) -> float:
    rid = f"timed-{next(_ids)}"
    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while not any(o.request_id == rid and o.new_token_ids for o in engine.step()):
        pass
    ms = 1e3 * (time.perf_counter() - start)
    while rid in engine.requests:  # its finish may come a step later
        engine.step()
    return ms


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="qwen3.5-27b", help="a shape of benchmarks/shapes.py")
    p.add_argument("--lengths", type=int, nargs="+", default=[2, 16, 64, 256, 500])
    p.add_argument("--beside", type=int, default=16, help="sequences decoding meanwhile")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    model_dir = checkpoint_dir(args.model, args.dtype)
    llm = LLM(
        model_dir,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
    )
    engine, graphs = llm.engine, llm.engine.runner.graphs
    table = graphs.prefill_bucket
    rng = random.Random(0)
    vocab = min(len(llm.tokenizer), 10000)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(vocab // 10, vocab) for _ in range(n)]

    def timed(n: int, graph: bool) -> float:
        graphs.prefill_bucket = table if graph else []
        return first_token_ms(engine, fresh(n))

    rows = []
    for beside in (0, args.beside):
        background = SamplingParams(max_tokens=args.max_model_len - 32, ignore_eos=True)
        for i in range(beside):
            engine.add_request(f"beside-{i}", fresh(16), background)
        for _ in range(4):  # their prompts in, then decoding
            engine.step()
        for n in args.lengths:
            for graph in (True, False):  # warm up: kernels compile at new shapes
                timed(n, graph)
            times = {True: [], False: []}
            for _ in range(args.repeats):
                for graph in (True, False):
                    times[graph].append(timed(n, graph))
            row = {"beside": beside, "prompt_tokens": n}
            row["graphs_ttft_ms"] = round(statistics.median(times[True]), 2)
            row["eager_ttft_ms"] = round(statistics.median(times[False]), 2)
            row["graphs_vs_eager"] = round(row["graphs_ttft_ms"] / row["eager_ttft_ms"], 3)
            rows.append(row)
            print(row, flush=True)
        for i in range(beside):
            engine.abort_request(f"beside-{i}")
        while engine.has_unfinished_requests():
            engine.step()
    graphs.prefill_bucket = table
    result = {
        **provenance("prompt_graphs", argv),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "model": args.model,
        "dtype": args.dtype,
        "prefill_graph_buckets": sorted(graphs.prefill),
        "walk_limit": engine.runner.walk_limit,
        "graph_limit": engine.runner.graph_limit,
        "rows": rows,
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
