"""Time to first token when the prompt's prefix is cached (a chat's next turn, a shared
system prompt), against the same length uncached, and against transformers' forward
over the new tokens given the prefix's KV (its own cache, `--compare-hf`), same GPU.

    python -m benchmarks.prefix_ttft --model llama3-8b --cases 1008:16 4032:64 7680:256 \
        --compare-hf --out benchmarks/results/prefix-ttft-llama3-8b-h200.json

A case PREFIX:NEW caches a random PREFIX-token prefix (a multiple of the block size, so
all of it is cached) by two prompts of it and NEW fresh tokens, then times `--repeats`
prompts of that prefix and NEW fresh tokens (`LLM.generate`, one output token: what a
client waits for), and as many prompts of PREFIX + NEW fresh tokens, which nothing
caches. Medians. The engine's step budget is its default (2048 tokens): an uncached
prompt past it takes several chunks.

A model with recurrent layers runs with the prefix cache asked for: the second caching
prompt saves its states where its cached KV blocks end (engine/state_snapshots.py), and
the timed ones start from there. `--compare-off` times the uncached prompts again with
the prefix cache off (an engine built anew), for what the saves cost a prompt.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.checkpoints import model_dir as checkpoint_dir
from benchmarks.provenance import provenance, write_result
from engine import LLM, SamplingParams


def ttft_ms(llm: LLM, prompt: list[int]) -> float:
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    return 1e3 * (time.perf_counter() - start)


def hf_new_tokens_ms(model, prefix: list[int], news: list[list[int]]) -> float:
    """transformers' forward over each NEW tokens given the prefix's cache (built once,
    cropped back after each), the median in ms."""
    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    with torch.inference_mode():
        past = model(torch.tensor([prefix], device=device), use_cache=True).past_key_values
        times = []
        for new in [news[0], *news]:  # the first warms up
            ids = torch.tensor([new], device=device)
            sync()
            start = time.perf_counter()
            model(ids, past_key_values=past, use_cache=True)
            sync()
            times.append(1e3 * (time.perf_counter() - start))
            past.crop(-len(new))  # back to the prefix alone
    return statistics.median(times[1:])


def release() -> None:
    """The engine's heap was frozen out of the collector (engine/heap.py): unfreeze it, so
    that its cycles, the KV cache among them, are freed before the next model loads."""
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="llama3-8b", help="a shape of benchmarks/shapes.py")
    p.add_argument("--cases", nargs="+", default=["1008:16", "4032:64", "7680:256"])
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--compare-hf", action="store_true")
    p.add_argument("--compare-off", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    cases = [tuple(int(x) for x in case.split(":")) for case in args.cases]
    model_dir = checkpoint_dir(args.model, args.dtype)
    longest = max(prefix + new for prefix, new in cases)

    def build(prefix_caching: bool) -> LLM:
        return LLM(
            model_dir,
            dtype=args.dtype,
            device=args.device,
            max_model_len=longest + 1,
            max_num_seqs=args.max_num_seqs,
            enable_prefix_caching=prefix_caching,
        )

    llm = build(True)
    block = llm.engine.config.block_size
    if any(prefix % block for prefix, _ in cases):
        p.error(f"each PREFIX must be a multiple of the block size ({block})")
    rng = random.Random(0)
    vocab = min(len(llm.tokenizer), 10000)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(vocab // 10, vocab) for _ in range(n)]

    rows, prefixes = [], {}
    ttft_ms(llm, fresh(longest))  # warm up: kernels compile at new shapes
    for prefix_len, new in cases:
        prefix = prefixes[prefix_len] = fresh(prefix_len)
        for _ in range(2):  # cache the prefix (and a recurrent model's states where it ends)
            ttft_ms(llm, prefix + fresh(new))
        news = [fresh(new) for _ in range(args.repeats)]
        cached = [ttft_ms(llm, prefix + n) for n in news]
        uncached = [ttft_ms(llm, fresh(prefix_len + new)) for _ in range(args.repeats)]
        row = {
            "cached_prefix": prefix_len,
            "new_tokens": new,
            "cached_ttft_ms": round(statistics.median(cached), 2),
            "uncached_ttft_ms": round(statistics.median(uncached), 2),
        }
        row["cached_vs_uncached"] = round(row["cached_ttft_ms"] / row["uncached_ttft_ms"], 3)
        row["news"] = news
        rows.append(row)
        print(row["cached_prefix"], new, row["cached_ttft_ms"], row["uncached_ttft_ms"], flush=True)
    stats = llm.engine.get_stats()
    snapshots = llm.engine.config.state_snapshots  # a recurrent model's snapshot rows
    del llm
    release()
    if args.compare_off:
        llm = build(False)
        ttft_ms(llm, fresh(longest))
        for row in rows:
            n = row["cached_prefix"] + row["new_tokens"]
            off = statistics.median(ttft_ms(llm, fresh(n)) for _ in range(args.repeats))
            row["uncached_ttft_ms_cache_off"] = round(off, 2)
        del llm
        release()
    if args.compare_hf:
        from benchmarks.hf_compile import load_model

        model = load_model(model_dir, getattr(torch, args.dtype))
        for row in rows:
            ms = hf_new_tokens_ms(model, prefixes[row["cached_prefix"]], row["news"])
            row["transformers_new_tokens_ms"] = round(ms, 2)
            row["cached_vs_transformers"] = round(row["cached_ttft_ms"] / ms, 3)
    for row in rows:
        del row["news"]
    result = {
        **provenance("prefix_ttft", argv),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "model": args.model,
        "dtype": args.dtype,
        "state_snapshots": snapshots,
        "prefix_cache_hits": stats.prefix_cache_hits,
        "cases": rows,
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
