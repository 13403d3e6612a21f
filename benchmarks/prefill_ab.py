"""Prefill attention A/B across trees: the kernel of whichever tree's `kernels/` comes
first on PYTHONPATH (this file imports nothing else of the project), per layer, each
layer on its own cache blocks (L2 cold), timed from CUDA graphs; on trees with key
splits, also at fixed split counts; for verify shapes (seqs x (1 + K) queries), the
per-token decode path too. Errors are against the fp32 reference.

    PYTHONPATH=<base tree> python benchmarks/prefill_ab.py base >  ab.jsonl
    PYTHONPATH=. python benchmarks/prefill_ab.py new [shape names] >> ab.jsonl

One JSON line per (shape, variant); benchmarks.prefill_attention times this tree alone.
"""

import dataclasses
import json
import sys

import torch
from triton.testing import do_bench_cudagraph

import kernels.prefill_attention as pa
from kernels.paged_attention import paged_attention_decode

dev = torch.device("cuda")
BS = 16
MODELS = {"gpt2": (12, 12, 64), "qwen": (14, 2, 64), "llama": (32, 8, 128)}
# name -> (model, [(query_len, context_len), ...])
SHAPES = {
    "verify1x5@300": ("llama", [(5, 300)]),
    "verify1x5@2k": ("llama", [(5, 2048)]),
    "verify1x5@8k": ("llama", [(5, 8192)]),
    "verify16x5@512": ("llama", [(5, 512)] * 16),
    "verify16x5@2k": ("llama", [(5, 2048)] * 16),
    "verify64x5@512": ("llama", [(5, 512)] * 64),
    "cached1x16@1k": ("llama", [(16, 1024)]),
    "cached1x64@4k": ("llama", [(64, 4096)]),
    "cached1x256@8k": ("llama", [(256, 8192)]),
    "chunk2048@8k": ("llama", [(2048, 8192)]),
    "prompt8191": ("llama", [(8191, 8191)]),
    "mixed2000+48": ("llama", [(2000, 2000)] + [(1, 512)] * 48),
    "batch16x128": ("llama", [(128, 128)] * 16),
    "qwen-verify1x5@512": ("qwen", [(5, 512)]),
    "qwen-prompt4096": ("qwen", [(4096, 4096)]),
    "qwen-mixed1000+100": ("qwen", [(1000, 1000)] + [(1, 400)] * 100),
    "gpt2-prompt2048": ("gpt2", [(2048, 2048)]),
    "gpt2-cached1x32@1k": ("gpt2", [(32, 1024)]),
}


def run_shape(tag, name):
    model, chunks = SHAPES[name]
    h, kvh, d = MODELS[model]
    dtype = torch.bfloat16
    torch.manual_seed(0)
    q_lens = [q for q, _ in chunks]
    s_lens = [s for _, s in chunks]
    seqs, tokens = len(chunks), sum(q_lens)
    max_blocks = max(-(-s // BS) for s in s_lens)
    layer_bytes = 2 * sum(s_lens) * kvh * d * 2
    layers = max(2, min(16, (768 << 20) // max(layer_bytes, 1)))
    nblocks = layers * seqs * max_blocks
    k = torch.randn(nblocks, BS, kvh, d, device=dev, dtype=dtype)
    v = torch.randn(nblocks, BS, kvh, d, device=dev, dtype=dtype)
    tables = torch.randperm(nblocks, device=dev, dtype=torch.int32).view(layers, seqs, max_blocks)
    q = torch.randn(layers, tokens, h, d, dtype=dtype, device=dev)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    lens = torch.tensor(s_lens, dtype=torch.int32, device=dev)
    max_q = max(q_lens)
    scale = d**-0.5
    variants = {"default": None}
    if "num_splits" in {f.name for f in dataclasses.fields(pa.PrefillConfig)}:
        base = pa.prefill_config(max_q, d, h // kvh)
        for n in (1, 4, 8, 16):
            variants[f"splits{n}"] = dataclasses.replace(base, num_splits=n)
    out = []

    def bench(fn):
        return do_bench_cudagraph(fn, rep=200) * 1e3 / layers

    ref = pa.paged_prefill_attention_ref(
        q[0].float(), k.float(), v.float(), tables[0], qsl, lens, scale, max_q
    )
    for vname, cfg in variants.items():

        def fn(cfg=cfg):
            for i in range(layers):
                pa.paged_prefill_attention(
                    q[i], k, v, tables[i], qsl, lens, scale, max_q, config=cfg
                )

        got = pa.paged_prefill_attention(q[0], k, v, tables[0], qsl, lens, scale, max_q, config=cfg)
        err = (got.float() - ref).abs().max().item()
        us = bench(fn)
        out.append(
            dict(
                tag=tag,
                shape=name,
                variant=vname,
                us=round(us, 2),
                err=err,
                layers=layers,
                kv_mb=round(layer_bytes / 2**20, 2),
            )
        )
    if all(ql <= 8 for ql in q_lens) and all(ql > 1 for ql in q_lens):  # verify: per-token decode
        rows = torch.repeat_interleave(
            torch.arange(seqs, device=dev), torch.tensor(q_lens, device=dev)
        )
        pos_lens = torch.cat([torch.arange(s - ql + 1, s + 1) for ql, s in chunks]).to(
            dev, torch.int32
        )
        ptables = tables[:, rows].contiguous()

        def fn():
            for i in range(layers):
                paged_attention_decode(q[i], k, v, ptables[i], pos_lens, scale)

        got = paged_attention_decode(q[0], k, v, ptables[0], pos_lens, scale)
        err = (got.float() - ref).abs().max().item()
        out.append(
            dict(
                tag=tag,
                shape=name,
                variant="per-token decode",
                us=round(bench(fn), 2),
                err=err,
                layers=layers,
                kv_mb=round(layer_bytes / 2**20, 2),
            )
        )
    return out


if __name__ == "__main__":
    tag = sys.argv[1]
    names = sys.argv[2:] or list(SHAPES)
    for name in names:
        for row in run_shape(tag, name):
            print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
