"""Speculative decoding against plain decoding, same GPU, same run.

    python -m benchmarks.speculative --model llama3-8b --num-requests 1 \
        --runs 0 0:echo 2:echo 4:echo 4:refused 4:lookup \
        --out benchmarks/results/speculative-llama3-8b-h200.json

Each run (K:DRAFTS; K = 0 is speculation off, asynchronous scheduling on, as served
by default) is a process of its own, on the same requests: random prompts of
--input-len tokens, greedy, EOS ignored. Acceptance depends on the weights, and
these are random, so the drafts are chosen by the benchmark:

    lookup    the engine's n-gram lookup (random weights rarely repeat themselves)
    echo      the engine's n-gram lookup, on a model made to repeat its last prompt
              token (its embeddings scaled up, so that they outweigh every layer's
              output, and the LM head set to them): every draft accepted, the best case
    refused   the tokens the K = 0 run produced next, plus one: every draft refused,
              the price of verifying

Reported per run: ms per output token over the decode phase, drafts proposed and
accepted, tokens a row gains per step, and the median step time by the drafts its
rows verify, which does not depend on the weights: with acceptance a per draft, a
step of d drafts yields (1 - a^(d+1)) / (1 - a) tokens a row, so the speedup at any
acceptance follows from these step times.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from benchmarks.checkpoints import model_dir as checkpoint_dir
from benchmarks.provenance import git_commit, write_result
from engine import LLM, SamplingParams


def prompts(num: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    out = []
    for _ in range(num):
        half = [rng.randrange(vocab) for _ in range(length // 2)]
        out.append(half + half[: length - len(half)])
    return out


def run_one(args: argparse.Namespace, k: int, drafts: str, reference: Path) -> dict:
    dtype = "bfloat16"
    model_dir = checkpoint_dir(args.model, dtype)
    spec = dict(num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=args.lookup_max)
    llm = LLM(
        model_dir,
        dtype=dtype,
        enable_prefix_caching=False,
        max_model_len=args.input_len + args.output_len + 16,
        max_num_seqs=args.max_num_seqs,
        **(spec if k else {}),
    )
    engine = llm.engine
    if drafts == "echo":  # same shapes, same kernels: only the values change
        model = engine.model
        embed = (model.embed_tokens if hasattr(model, "embed_tokens") else model.wte).weight
        with torch.no_grad():
            embed.mul_(1000.0)
            model.lm_head.weight[: len(embed)].copy_(embed)
    requests = prompts(args.num_requests, args.input_len, min(len(llm.tokenizer), 10000))
    warm = SamplingParams(max_tokens=16, ignore_eos=True, temperature=args.temperature)
    if k:  # warm the verify steps up too: drafts of whatever came last
        engine.speculator.draft = lambda slot, tokens, n: tokens[-1:].repeat(n)
    llm.generate(requests, warm, use_tqdm=False)
    if k and drafts == "refused":
        outputs = json.loads(reference.read_text())
        vocab = engine.vocab_size

        def scripted(slot: int, tokens: np.ndarray, n: int) -> np.ndarray:
            req = engine.batch.requests[slot]
            done = len(tokens) - len(req.prompt_token_ids)
            return (np.array(outputs[req.request_id][done : done + n]) + 1) % vocab

        engine.speculator.draft = scripted
    elif k:
        del engine.speculator.draft  # the class's: n-gram lookup
    params = SamplingParams(
        max_tokens=args.output_len, temperature=args.temperature, ignore_eos=True, final_only=True
    )
    for i, ids in enumerate(requests):
        engine.add_request(str(i), ids, params)
    schedule, scheduled = engine.scheduler.schedule, []

    def keep_schedule():
        scheduled.append(schedule())
        return scheduled[-1]

    engine.scheduler.schedule = keep_schedule
    by_drafts: dict[int, list[float]] = defaultdict(list)  # max drafts a row -> step seconds
    decode_s, decode_steps = 0.0, 0
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    finished = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        finished += engine.step()
        seconds = time.perf_counter() - start
        out = scheduled.pop()
        if not out or out.admitted or out.num_sampling < out.num_seqs:
            continue  # a step with prefill
        most = 0 if out.num_drafts is None else int(out.num_drafts.max())
        by_drafts[most].append(seconds)
        decode_s += seconds
        decode_steps += 1
    del engine.scheduler.schedule
    if drafts == "plain":  # what the refused runs draft
        reference.write_text(json.dumps({o.request_id: o.new_token_ids for o in finished}))
    tokens = sum(o.num_output_tokens for o in finished)
    assert tokens == args.num_requests * args.output_len
    stats = engine.get_stats()
    # The first token of each comes from its prefill step.
    decode_tokens = tokens - args.num_requests
    return {
        "k": k,
        "drafts": drafts,
        "ms_per_token": 1e3 * decode_s / (decode_tokens / args.num_requests),
        "decode_steps": decode_steps,
        "tokens_per_row_per_step": decode_tokens / args.num_requests / decode_steps,
        "draft_tokens": stats.spec_decode_num_draft_tokens,
        "accepted_tokens": stats.spec_decode_num_accepted_tokens,
        "acceptance": stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_draft_tokens
        if stats.spec_decode_num_draft_tokens
        else None,
        "step_ms_by_drafts": {
            d: {"p50": 1e3 * statistics.median(s), "steps": len(s)}
            for d, s in sorted(by_drafts.items())
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="llama3-8b", help="a shape of benchmarks/shapes.py")
    p.add_argument("--num-requests", type=int, default=1)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument(
        "--runs",
        nargs="+",
        default=["0", "0:echo", "2:echo", "4:echo", "4:refused", "4:lookup"],
        metavar="K:DRAFTS",
        help="K draft tokens (0: off) and where they come from: lookup, echo, refused "
        "(refused needs a plain K = 0 run first); 0:echo is the echo model without them",
    )
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--lookup-max", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child's K:DRAFTS
    p.add_argument("--reference", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.one is not None:
        k, _, drafts = args.one.partition(":")
        drafts = drafts or ("lookup" if int(k) else "plain")
        print(json.dumps(run_one(args, int(k), drafts, args.reference)))
        return 0
    argv = list(argv if argv is not None else sys.argv[1:])
    runs = []
    reference = Path(tempfile.mkdtemp()) / "outputs.json"
    for run in args.runs:
        child = [sys.executable, "-m", "benchmarks.speculative", *argv, "--one", run]
        child += ["--reference", str(reference)]
        done = subprocess.run(child, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"run {run} failed:\n{done.stderr[-4000:]}")
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(runs[-1]), flush=True)
    # Against decoding without speculation, on the same model (the echo model's own).
    base = {r["drafts"] == "echo": r["ms_per_token"] for r in runs if r["k"] == 0}
    for run in runs:
        plain = base.get(run["drafts"] == "echo", base.get(False))  # speed is the values
        run["speedup"] = plain / run["ms_per_token"] if plain else None
    result = {
        "benchmark": "speculative",
        "command": "python -m benchmarks.speculative " + " ".join(argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "commit": git_commit(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "model": args.model,
        "num_requests": args.num_requests,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "temperature": args.temperature,
        "max_num_seqs": args.max_num_seqs,
        "prompt_lookup": [1, args.lookup_max],
        "runs": runs,
    }
    write_result(args.out, result)
    for run in runs:
        print(
            f"K={run['k']} {run['drafts']}: {run['ms_per_token']:.2f} ms/token, "
            f"{run['tokens_per_row_per_step']:.2f} tokens/step, acceptance {run['acceptance']}, "
            f"speedup {run['speedup']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
