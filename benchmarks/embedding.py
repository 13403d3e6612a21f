"""Embedding throughput of an encoder, against transformers on the same GPU.

    python -m benchmarks.embedding --model bert-base --num-requests 4096 \
        --min-len 16 --max-len 512 --compare-hf --out benchmarks/results/embedding-bert-base.json

Random prompts of lengths uniform in [min, max] are embedded by `LLM.embed` (CLS
pooling, normalized), once per `--max-num-batched-tokens` given (the step's token
budget). Each side embeds the whole workload once untimed first (Triton compiles its
kernels per shape class), then once timed. transformers embeds the same prompts as sentence-transformers batches them:
sorted by length, `--hf-batch-size` at a time, padded within the batch, through
`AutoModel` with its default attention (SDPA), the CLS state normalized. Both in the
same dtype; the embeddings' cosine similarity is reported, and each side's TFLOPS
(2 x non-embedding parameters per token, plus attention's 4 x layers x hidden x len^2
per prompt) against the dense bf16 peak given by `--peak-tflops`.
"""

from __future__ import annotations

import argparse
import functools
import gc
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.checkpoints import model_dir as checkpoint_dir
from benchmarks.provenance import provenance, write_result
from engine import LLM


def flops(config, lengths: list[int], dense_params: int) -> float:
    """A forward's FLOPs over the prompts: the projections' 2 per parameter and token, and
    attention's scores and weighted sum, 2 x 2 x hidden per query-key pair and layer."""
    tokens = sum(lengths)
    pairs = sum(n * n for n in lengths)
    return 2.0 * dense_params * tokens + 4.0 * config.num_hidden_layers * config.hidden_size * pairs


def rates(seconds: float, lengths: list[int], work: float, peak_tflops: float) -> dict:
    """A timed pass's figures: tokens and prompts a second, TFLOPS and their share of peak."""
    tflops = work / seconds / 1e12
    return {
        "seconds": round(seconds, 3),
        "tok_s": round(sum(lengths) / seconds),
        "req_s": round(len(lengths) / seconds, 1),
        "tflops": round(tflops, 1),
        "vs_peak": round(tflops / peak_tflops, 3),
    }


def hf_embed(model, prompts: list[list[int]], batch_size: int, pad_id: int) -> np.ndarray:
    """CLS embeddings, normalized, in the prompts' order (batched by length)."""
    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out = np.zeros((len(prompts), model.config.hidden_size), dtype=np.float32)
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            width = max(len(prompts[i]) for i in rows)
            ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for j, i in enumerate(rows):
                ids[j, : len(prompts[i])] = torch.tensor(prompts[i])
                mask[j, : len(prompts[i])] = 1
            states = model(input_ids=ids.to(device), attention_mask=mask.to(device))
            cls = torch.nn.functional.normalize(states.last_hidden_state[:, 0].float(), dim=-1)
            out[rows] = cls.cpu().numpy()
    return out


def timed(fn) -> tuple[float, object]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="bert-base", help="bert-base | bge-m3, or a directory")
    p.add_argument("--num-requests", type=int, default=4096)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int, nargs="+", default=[8192])
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--compare-hf", action="store_true")
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 (H100/H200)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    model_dir = checkpoint_dir(args.model, args.dtype)
    from transformers import AutoConfig

    rng = random.Random(0)
    lengths = [rng.randint(args.min_len, args.max_len) for _ in range(args.num_requests)]
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    # Ids from the top nine tenths: never a special token (RoBERTa's pad is 1).
    prompts = [[rng.randrange(vocab // 10, vocab) for _ in range(n)] for n in lengths]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = provenance("embedding", argv) | {
        "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "model": args.model,
        "dtype": args.dtype,
        "num_requests": args.num_requests,
        "prompt_tokens": sum(lengths),
        "lengths": f"uniform in [{args.min_len}, {args.max_len}]",
        "peak_tflops": args.peak_tflops,
        "runs": [],
    }
    pagoda = None
    for budget in args.max_num_batched_tokens:
        llm = LLM(
            model_dir,
            dtype=args.dtype,
            max_model_len=args.max_len,
            max_num_batched_tokens=budget,
            max_num_seqs=args.max_num_seqs,
        )
        config, embed = llm.engine.model.config, llm.engine.model
        dense = sum(p.numel() for n, p in embed.named_parameters() if "embeddings" not in n)
        work = flops(config, lengths, dense)
        llm.embed(prompts, use_tqdm=False)  # warm up: kernels compile per shape
        seconds, vectors = timed(functools.partial(llm.embed, prompts, use_tqdm=False))
        run = {"engine": "pagoda", "max_num_batched_tokens": budget}
        run |= rates(seconds, lengths, work, args.peak_tflops)
        result["runs"].append(run)
        print(run, flush=True)
        pagoda = np.asarray(vectors, dtype=np.float32)
        del llm
        gc.unfreeze()  # the engine's heap was frozen (engine/heap.py): free it
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.compare_hf:
        from transformers import AutoModel

        dtype = getattr(torch, args.dtype)
        model = AutoModel.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        pad = model.config.pad_token_id or 0
        hf_embed(model, prompts, args.hf_batch_size, pad)  # warm up, as Pagoda's
        seconds, hf = timed(functools.partial(hf_embed, model, prompts, args.hf_batch_size, pad))
        run = {"engine": "transformers", "batch_size": args.hf_batch_size}
        run["attn_implementation"] = model.config._attn_implementation
        run |= rates(seconds, lengths, work, args.peak_tflops)
        result["runs"].append(run)
        print(run, flush=True)
        cosine = (pagoda * hf).sum(axis=1)
        result["cosine_vs_transformers"] = {
            "min": round(float(cosine.min()), 5),
            "mean": round(float(cosine.mean()), 5),
        }
        best = max(r["tok_s"] for r in result["runs"] if r["engine"] == "pagoda")
        result["speedup_vs_transformers"] = round(best / run["tok_s"], 2)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
