"""Greedy agreement with transformers: Pagoda's tokens against transformers' on the same
checkpoint, dtype and device.

    python -m benchmarks.agreement --model llama3-8b \
        --out benchmarks/results/agreement-llama3-8b-h100.json
    python -m benchmarks.agreement --model-dir .cache/pagoda-demo --device cpu \
        --dtype float32 --num-requests 8 --max-tokens 32          # a quick look on the CPU

N distinct prompts (random token ids, or `--prompts text`), lengths cycling over
16/32/48/64 tokens so that transformers runs batches of one length (no padding,
whose masked positions would change its own numerics), M greedy tokens each,
EOS ignored. Pagoda runs them as one batch through `LLM.generate` (CUDA graphs
unless `--enforce-eager`), then, with Pagoda's engine freed, transformers runs
`generate(do_sample=False)`. Reported:

- free-running agreement: the fraction of the N x M positions where the two
  agree, the mean position of each request's first divergence (M when none), and
  how many requests agree throughout. After a divergence the two continue from
  different texts, so one near-tie costs every position after it.
- teacher-forced top-1 agreement: transformers' argmax at every position of
  Pagoda's own output (one forward over prompt + output) against Pagoda's token;
  each position is judged on its own, without the cascade. At each disagreement,
  the gap between transformers' top logit and its logit for Pagoda's token, beside
  transformers' top-1/top-2 margin over all positions. The same judgement of
  transformers' own generate output (`transformers_self`) is the floor: what
  incremental decoding against one full forward costs in this dtype by itself.

Random weights (the llama3-8b / qwen2-0.5b / gpt2 shapes) give near-flat logits
and repetitive outputs: agreement there shows the kernels compute the same
function, not that a real model's text survives bf16. `--model-dir` takes a real
checkpoint.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.provenance import provenance, write_result

PROMPT_LENGTHS = (16, 32, 48, 64)
BAR = 0.95  # issue 35: >= 95% of tokens agree, 64 requests x 128 tokens
TEXTS = [
    "The history of the printing press begins in the fifteenth century.",
    "A recipe for bread needs flour, water, salt and a little patience.",
    "In distributed systems, a consensus protocol lets machines agree on one value.",
    "The river flowed past the old mill, where children used to play.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b",
    "Dear team, the quarterly report is attached; please read it before Monday.",
    "The orchestra tuned their instruments as the audience took their seats.",
    "Mount Everest is the highest mountain above sea level on Earth.",
    "To install the package, run pip install and then import it in Python.",
    "She opened the letter slowly, unsure what news it would bring.",
    "Prime numbers have exactly two divisors: one and themselves.",
]


def make_prompts(kind: str, n: int, vocab: int, tokenizer, seed: int) -> list[list[int]]:
    """n distinct prompts, the i-th PROMPT_LENGTHS[i % 4] tokens long."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    while len(prompts) < n:
        length = PROMPT_LENGTHS[len(prompts) % len(PROMPT_LENGTHS)]
        if kind == "random":
            ids = [rng.randrange(min(vocab, 10000)) for _ in range(length)]
        else:  # sentences in a random order until long enough, cut to the length
            ids = []
            while len(ids) < length:
                ids += tokenizer.encode(" " + rng.choice(TEXTS), add_special_tokens=False)
            ids = ids[:length]
        if ids not in prompts:
            prompts.append(ids)
    return prompts


def run_pagoda(model_dir: str, args, prompts: list[list[int]]) -> tuple[list[list[int]], dict]:
    from engine import LLM, SamplingParams

    llm = LLM(
        model_dir,
        device=args.device,
        dtype=args.dtype,
        enable_prefix_caching=False,
        enforce_eager=args.enforce_eager,
        max_num_seqs=max(len(prompts), 1),
        max_model_len=max(PROMPT_LENGTHS) + args.max_tokens,
        # transformers runs in the same process after this engine is freed; room for
        # both while the KV cache is sized is not needed, but leave the allocator slack.
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    info = {
        "generate_s": elapsed,
        "steps_by_path": dict(llm.engine.runner.steps_by_path),
        "vocab_size": llm.engine.vocab_size,
    }
    tokens = [o.outputs[0].token_ids for o in outputs]
    llm.shutdown()
    del llm, outputs
    # The engine's heap was frozen out of the collector (engine/heap.py): unfreeze it,
    # so that its cycles (the KV cache, graph pools) are freed before transformers loads.
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return tokens, info


def by_length(prompts: list[list[int]], batch: int) -> list[list[int]]:
    """Indices of the prompts in batches of one length."""
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(len(p), []).append(i)
    return [idx[j : j + batch] for idx in groups.values() for j in range(0, len(idx), batch)]


@torch.inference_mode()
def run_hf_generate(model, prompts: list[list[int]], max_tokens: int, batch: int, device):
    tokens: list[list[int]] = [[] for _ in prompts]
    for idx in by_length(prompts, batch):
        ids = torch.tensor([prompts[i] for i in idx], device=device)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            pad_token_id=0,
        )
        for row, i in enumerate(idx):
            tokens[i] = out[row, ids.shape[1] :].tolist()
    return tokens


@torch.inference_mode()
def teacher_forced(
    model, prompts: list[list[int]], outputs: list[list[int]], batch: int, device
) -> dict:
    """transformers' argmax at each output position, given the prompt and `outputs`
    before it, against `outputs`."""
    agree = total = 0
    gaps: list[float] = []  # top logit - the output token's logit, at disagreements
    margins: list[float] = []  # top-1 - top-2 logit, at every position
    for idx in by_length(prompts, batch):
        length = len(prompts[idx[0]])
        seqs = torch.tensor([prompts[i] + outputs[i] for i in idx], device=device)
        logits = model(seqs).logits[:, length - 1 : -1].float()  # [B, T, vocab]
        target = seqs[:, length:]  # [B, T]
        top2 = logits.topk(2, dim=-1).values  # [B, T, 2]
        chosen = logits.gather(-1, target[..., None])[..., 0]
        hit = logits.argmax(-1) == target
        agree += int(hit.sum())
        total += hit.numel()
        gaps += (top2[..., 0] - chosen)[~hit].tolist()
        margins += (top2[..., 0] - top2[..., 1]).flatten().tolist()
    return {
        "top1_agreement": agree / total,
        "positions": total,
        "disagreements": total - agree,
        "gap_at_disagreements": quantiles(gaps),
        "top1_top2_margin_all_positions": quantiles(margins),
    }


def quantiles(values: list[float]) -> dict | None:
    if not values:
        return None
    values = sorted(values)

    def at(q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))]

    return {
        "n": len(values),
        "mean": statistics.fmean(values),
        "p50": at(0.5),
        "p90": at(0.9),
        "max": values[-1],
    }


def free_running(a: list[list[int]], b: list[list[int]], max_tokens: int) -> dict:
    same = sum(x == y for sa, sb in zip(a, b) for x, y in zip(sa, sb))
    total = sum(min(len(sa), len(sb)) for sa, sb in zip(a, b))
    firsts = []
    for sa, sb in zip(a, b):
        diff = [t for t, (x, y) in enumerate(zip(sa, sb)) if x != y]
        firsts.append(diff[0] if diff else min(len(sa), len(sb), max_tokens))
    return {
        "token_agreement": same / total,
        "positions": total,
        "mean_first_divergence": statistics.fmean(firsts),
        "requests_identical": sum(sa == sb for sa, sb in zip(a, b)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        default="llama3-8b",
        choices=["gpt2", "qwen2-0.5b", "llama3-8b"],
        help="random-weight checkpoint at this model's shapes (written to disk once)",
    )
    p.add_argument("--model-dir", default=None, help="a checkpoint directory instead")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompts", default="random", choices=["random", "text"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-batch-size", type=int, default=16, help="transformers' batch")
    p.add_argument("--enforce-eager", action="store_true", help="Pagoda without CUDA graphs")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.checkpoints import disk_checkpoint

    model_dir = args.model_dir or disk_checkpoint(args.model, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = make_prompts(args.prompts, args.num_requests, len(tokenizer), tokenizer, args.seed)
    pagoda, pagoda_info = run_pagoda(model_dir, args, prompts)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # EOS ignored, as Pagoda's ignore_eos
    start = time.perf_counter()
    hf = run_hf_generate(model, prompts, args.max_tokens, args.hf_batch_size, device)
    hf_s = time.perf_counter() - start

    result = {
        **provenance("agreement", argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "model": args.model_dir or args.model,
        "random_weights": args.model_dir is None,
        "dtype": args.dtype,
        "num_requests": len(prompts),
        "max_tokens": args.max_tokens,
        "prompts": args.prompts,
        "prompt_lengths": sorted({len(x) for x in prompts}),
        "cuda_graphs": device.type == "cuda" and not args.enforce_eager,
        "pagoda": pagoda_info,
        "transformers_generate_s": hf_s,
        "bar": BAR,
        "free_running": free_running(pagoda, hf, args.max_tokens),
        "teacher_forced": teacher_forced(model, prompts, pagoda, args.hf_batch_size, device),
        "transformers_self": teacher_forced(model, prompts, hf, args.hf_batch_size, device),
        "note": "free_running.token_agreement is the issue's figure (bar: >= 0.95). "
        "teacher_forced judges each of Pagoda's tokens by transformers' argmax given "
        "Pagoda's own prefix, so one near-tie does not cost the rest of the sequence; "
        "gap_at_disagreements (logits) says how near a tie each disagreement was, beside "
        "the top-1/top-2 margin at every position. transformers_self is transformers' "
        "generate output judged the same way: the dtype's own floor. With random weights "
        "logits are near-flat and outputs repetitive: this shows the same function is "
        "computed, not that a real model's text is preserved in bf16.",
    }
    result["passes_bar"] = result["free_running"]["token_agreement"] >= BAR
    print(json.dumps(result, indent=2))
    fr, tf = result["free_running"], result["teacher_forced"]
    print(
        f"free-running agreement {fr['token_agreement']:.4f} (first divergence at "
        f"{fr['mean_first_divergence']:.1f} on average, {fr['requests_identical']}/"
        f"{len(prompts)} identical); teacher-forced top-1 {tf['top1_agreement']:.4f} "
        f"(transformers against itself {result['transformers_self']['top1_agreement']:.4f})",
        file=sys.stderr,
    )
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
