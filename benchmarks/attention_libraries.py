"""Pagoda's attention kernels against the libraries made for the field, on one GPU.

    python -m benchmarks.attention_libraries --out benchmarks/results/attention-libraries-h200.json

Decode (one query token a sequence, Llama-3-8B's and Qwen2.5-0.5B's heads, bf16 queries,
bf16 or e4m3 cache): Pagoda's kernel alone and as the engine calls it (storing the new
K/V and rotating q and K first), against FlashInfer's decode on CUDA cores and on tensor
cores, and TensorRT-LLM's XQA kernel as FlashInfer ships it. Each layer reads its own
shuffled cache blocks, as a long-running server's are; times are per layer, replayed from
a CUDA graph over the layers. Prefill (one prompt of benchmarks.prefill_attention's
shapes, causal, bf16): Pagoda's paged kernel, PyTorch's SDPA on contiguous K/V with the
backend it picks itself (what transformers runs) and with its flash and cuDNN backends,
and FlashInfer's paged prefill with its FA2 and FA3 backends; times per call, replayed
from a CUDA graph of ten calls, so no host overhead is counted.

FlashInfer is optional (`pip install -e '.[attention-libraries]'`; it compiles its kernels
with nvcc on first use): without it only Pagoda's and PyTorch's rows are measured.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.floors import copy_bandwidth
from benchmarks.prefill_attention import SHAPES as PREFILL_SHAPES
from benchmarks.provenance import git_commit, package_version, write_result
from kernels.attention_ref import paged_attention_decode_ref
from kernels.fp8 import FP8_DTYPE
from kernels.paged_attention import paged_attention_decode
from kernels.prefill_attention import paged_prefill_attention
from kernels.rotary import Rope

BLOCK_SIZE = 16
HEADS = {"llama3-8b": (32, 8, 128), "qwen2.5-0.5b": (14, 2, 64)}  # q heads, kv heads, dim
# (model, sequences, context, cache): the FP8 benchmark's shapes, batch 1, and Qwen's
# nano-vllm-like batch.
DECODE_CASES = [
    ("llama3-8b", 64, 768, "fp8"),
    ("llama3-8b", 128, 512, "fp8"),
    ("llama3-8b", 1, 512, "fp8"),
    ("llama3-8b", 64, 768, "bf16"),
    ("llama3-8b", 1, 512, "bf16"),
    ("qwen2.5-0.5b", 128, 512, "bf16"),
]
DECODE_VARIANTS = ("pagoda", "flashinfer", "flashinfer_tc", "xqa", "pagoda_engine")
PREFILL_VARIANTS = (
    "pagoda", "sdpa", "sdpa_flash", "sdpa_cudnn", "flashinfer_fa2", "flashinfer_fa3"
)  # fmt: skip
FP8_SCALE = 1.2  # the FP8 cache's k_scale and v_scale


@dataclass(frozen=True)
class PagedCsr:
    """A block table as FlashInfer takes it: each sequence's pages in one flat list."""

    indptr: (
        torch.Tensor
    )  # [num_seqs + 1] int32: sequence i's pages are indices[indptr[i]:indptr[i + 1]]
    indices: torch.Tensor  # int32 block ids
    last_page_len: torch.Tensor  # [num_seqs] int32, tokens in each sequence's last page


def page_csr(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> PagedCsr:
    """The first ceil(len / block_size) blocks of each row; a sequence of length 0 has none."""
    pages = (seq_lens + block_size - 1) // block_size
    indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32, device=block_table.device)
    indptr[1:] = pages.cumsum(0)
    keep = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < pages[:, None]
    last = torch.where(seq_lens > 0, (seq_lens - 1) % block_size + 1, 0)
    return PagedCsr(indptr, block_table[keep].to(torch.int32), last.to(torch.int32))


class DecodeCase:
    """One decode shape's caches, queries and per-layer block tables on the GPU."""

    def __init__(self, model: str, seqs: int, context: int, cache: str) -> None:
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.name = f"{model} {seqs}x{context} {cache}"
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim = HEADS[model]
        self.cache_dtype = FP8_DTYPE if cache == "fp8" else torch.bfloat16
        self.seqs, self.context = seqs, context + 1  # the new token is attended to as well
        self.pages = -(-self.context // BLOCK_SIZE)
        layer_bytes = (
            2 * seqs * self.pages * BLOCK_SIZE * kv_heads * dim * self.cache_dtype.itemsize
        )
        self.layers = max(2, min(32, (512 << 20) // layer_bytes))  # several times the L2
        blocks = self.layers * seqs * self.pages

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16)

        self.k = (randn(blocks, BLOCK_SIZE, kv_heads, dim) * 0.5).to(self.cache_dtype)
        self.v = (randn(blocks, BLOCK_SIZE, kv_heads, dim) * 0.5).to(self.cache_dtype)
        order = torch.randperm(blocks, device="cuda", generator=gen).to(torch.int32)
        self.tables = order.view(self.layers, seqs, self.pages)
        self.lens = torch.full((seqs,), self.context, dtype=torch.int32, device="cuda")
        self.q = randn(self.layers, seqs, heads, dim)
        self.out = torch.empty(seqs, heads, dim, dtype=torch.bfloat16, device="cuda")
        self.kv_scale = FP8_SCALE if cache == "fp8" else 1.0
        self.scale = dim**-0.5
        self.workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
        self.xqa_workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
        self.kv_bytes = 2 * seqs * self.context * kv_heads * dim * self.cache_dtype.itemsize

    def reference(self) -> torch.Tensor:
        return paged_attention_decode_ref(
            self.q[0], self.k, self.v, self.tables[0], self.lens, self.scale,
            k_scale=self.kv_scale, v_scale=self.kv_scale,
        )  # fmt: skip

    def runner(self, variant: str) -> Callable[[int], object]:
        """run(layer) for one variant; any planning happens here, outside the graph."""
        c, scales = self, {"k_scale": self.kv_scale, "v_scale": self.kv_scale}
        if variant == "pagoda":
            return lambda i: paged_attention_decode(
                c.q[i], c.k, c.v, c.tables[i], c.lens, c.scale, out=c.out, **scales
            )
        if variant == "pagoda_engine":  # stores into the cache: measured last
            gen = torch.Generator(device="cuda").manual_seed(1)
            new_k, new_v = (
                torch.randn(c.layers, c.seqs, c.kv_heads, c.head_dim, device="cuda",
                            generator=gen, dtype=torch.bfloat16)
                for _ in range(2)
            )  # fmt: skip
            last = (c.lens - 1).long()
            rows = torch.arange(c.seqs, device="cuda")
            slots = [c.tables[i, rows, last // BLOCK_SIZE].long() * BLOCK_SIZE + last % BLOCK_SIZE
                     for i in range(c.layers)]  # fmt: skip
            inv_freq = 500000.0 ** -(torch.arange(0, c.head_dim, 2, device="cuda") / c.head_dim)
            angles = torch.arange(c.context, device="cuda")[:, None] * inv_freq[None, :]
            rope = Rope(last, torch.cat([angles.cos(), angles.sin()], dim=-1))
            return lambda i: paged_attention_decode(
                c.q[i], c.k, c.v, c.tables[i], c.lens, c.scale, out=c.out, new_k=new_k[i],
                new_v=new_v[i], slot_mapping=slots[i], rope=rope, **scales,
            )  # fmt: skip
        import flashinfer
        from flashinfer.decode import xqa_batch_decode_with_kv_cache

        if variant == "xqa":  # one scale for K and V: FP8_SCALE for both
            return lambda i: xqa_batch_decode_with_kv_cache(
                c.q[i], (c.k, c.v), c.xqa_workspace, c.tables[i], c.lens, c.context,
                bmm1_scale=c.scale * c.kv_scale, bmm2_scale=c.kv_scale, out=c.out,
            )  # fmt: skip
        wrappers = []
        for i in range(c.layers):
            csr = page_csr(c.tables[i], c.lens, BLOCK_SIZE)
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                c.workspace, "NHD", use_cuda_graph=True,
                use_tensor_cores=variant == "flashinfer_tc", paged_kv_indptr_buffer=csr.indptr,
                paged_kv_indices_buffer=csr.indices, paged_kv_last_page_len_buffer=csr.last_page_len,
            )  # fmt: skip
            wrapper.plan(
                csr.indptr, csr.indices, csr.last_page_len, c.heads, c.kv_heads, c.head_dim,
                BLOCK_SIZE, q_data_type=torch.bfloat16, kv_data_type=c.cache_dtype, sm_scale=c.scale,
            )  # fmt: skip
            wrappers.append(wrapper)
        fp8 = scales if c.cache_dtype == FP8_DTYPE else {}
        return lambda i: wrappers[i].run(c.q[i], (c.k, c.v), out=c.out, **fp8)


def graph_us(run: Callable[[int], object], layers: int) -> float:
    """Median µs per call of a CUDA graph of run(0), ..., run(layers - 1)."""
    for i in range(layers):
        run(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(layers):
            run(i)
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (5 * layers))
    return sorted(times)[len(times) // 2]


def bench_decode(case: DecodeCase, variant: str, copy_gb_s: float) -> dict:
    row = {"kind": "decode", "case": case.name, "variant": variant, "layers": case.layers}
    try:
        run = case.runner(variant)
        run(0)
        if variant != "pagoda_engine":
            diff = (case.out.float() - case.reference().float()).abs().max().item()
            row["max_abs_diff"] = round(diff, 5)
        us = graph_us(run, case.layers)
    except Exception as e:  # noqa: BLE001 - a library's unsupported shape is a result
        return row | {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    floor = case.kv_bytes / copy_gb_s / 1e3
    return row | {"us": round(us, 2), "floor_us": round(floor, 2), "vs_floor": round(us / floor, 3)}


def bench_prefill(name: str, variants: tuple[str, ...], timed: bool = True) -> list[dict]:
    tokens, heads, kv_heads, dim = PREFILL_SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(tokens, h, dim, dtype=torch.bfloat16, device="cuda", generator=gen)
        for h in (heads, kv_heads, kv_heads)
    )  # fmt: skip
    blocks = -(-tokens // BLOCK_SIZE)
    order = torch.randperm(blocks, device="cuda", generator=gen).to(torch.int32)
    k_cache = torch.zeros(blocks, BLOCK_SIZE, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    pad = (0, 0, 0, 0, 0, blocks * BLOCK_SIZE - tokens)
    k_cache[order.long()] = F.pad(k, pad).view(blocks, BLOCK_SIZE, kv_heads, dim)
    v_cache[order.long()] = F.pad(v, pad).view(blocks, BLOCK_SIZE, kv_heads, dim)
    table, scale = order[None].contiguous(), dim**-0.5
    starts = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    lens = starts[1:].clone()
    group = heads // kv_heads
    q4 = q.transpose(0, 1)[None]
    k4, v4 = (x.repeat_interleave(group, dim=1).transpose(0, 1)[None].contiguous() for x in (k, v))

    def sdpa(backend: SDPBackend | None) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            chosen = contextlib.nullcontext() if backend is None else sdpa_kernel(backend)
            with chosen:
                out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale)
            return out[0].transpose(0, 1)

        return run

    def flashinfer_prefill(backend: str) -> Callable[[], torch.Tensor]:
        import flashinfer

        csr = page_csr(table, lens, BLOCK_SIZE)
        # Planned for CUDA graphs, FA2 sizes its split-KV buffers for the worst case.
        workspace = torch.zeros(1 << 30, dtype=torch.uint8, device="cuda")
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=starts,
            paged_kv_indptr_buf=csr.indptr, paged_kv_indices_buf=csr.indices,
            paged_kv_last_page_len_buf=csr.last_page_len, backend=backend,
        )  # fmt: skip
        wrapper.plan(
            starts, csr.indptr, csr.indices, csr.last_page_len, heads, kv_heads, dim, BLOCK_SIZE,
            causal=True, sm_scale=scale, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
        )  # fmt: skip
        return lambda: wrapper.run(q, (k_cache, v_cache))

    makers = {
        "pagoda": lambda: (
            lambda: paged_prefill_attention(q, k_cache, v_cache, table, starts, lens, scale, tokens)
        ),
        "sdpa": lambda: sdpa(None),
        "sdpa_flash": lambda: sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa_cudnn": lambda: sdpa(SDPBackend.CUDNN_ATTENTION),
        "flashinfer_fa2": lambda: flashinfer_prefill("fa2"),
        "flashinfer_fa3": lambda: flashinfer_prefill("fa3"),
    }
    want = sdpa(SDPBackend.FLASH_ATTENTION)().float()
    flops = 4 * tokens * tokens / 2 * dim * heads  # the causal half of QK^T and PV
    rows = []
    for variant in variants:
        row = {"kind": "prefill", "case": f"{name} {tokens} tokens", "variant": variant}
        try:
            run = makers[variant]()
            diff = (run().float() - want).abs().max().item()
            if not timed:  # a build: run once, capture nothing (other threads run too)
                continue
            us = graph_us(lambda _, run=run: run(), 10)
            row |= {"us": round(us, 1), "tflops": round(flops / us / 1e6, 1),
                    "max_abs_diff": round(diff, 5)}  # fmt: skip
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
    return rows


def build_flashinfer(cases: list[DecodeCase]) -> float:
    """Compile FlashInfer's kernels for every case at once (nvcc, one module a shape), so
    the timed runs below find them built; returns the seconds it took."""
    jobs: list[Callable[[], object]] = [
        (lambda c=c, v=v: c.runner(v)(0)) for c in cases for v in DECODE_VARIANTS
        if v.startswith(("flashinfer", "xqa"))
    ]  # fmt: skip
    jobs += [
        (lambda n=n: bench_prefill(n, PREFILL_VARIANTS[4:], timed=False)) for n in PREFILL_SHAPES
    ]

    def attempt(job: Callable[[], object]) -> None:
        with contextlib.suppress(Exception):  # reported again by the timed run
            job()

    start = datetime.datetime.now()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(attempt, jobs))
    torch.cuda.synchronize()
    return (datetime.datetime.now() - start).total_seconds()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks.attention_libraries needs a CUDA device")
    have_flashinfer = package_version("flashinfer-python") is not None
    decode_variants = DECODE_VARIANTS if have_flashinfer else ("pagoda", "pagoda_engine")
    prefill_variants = PREFILL_VARIANTS if have_flashinfer else PREFILL_VARIANTS[:4]
    copy_gb_s = copy_bandwidth() / 1e9
    cases = [DecodeCase(*shape) for shape in DECODE_CASES]
    build_s = build_flashinfer(cases) if have_flashinfer else 0.0
    rows = []
    for case in cases:
        for variant in decode_variants:
            rows.append(bench_decode(case, variant, copy_gb_s))
            print(json.dumps(rows[-1]), flush=True)
    del cases
    torch.cuda.empty_cache()
    for name in PREFILL_SHAPES:
        for row in bench_prefill(name, prefill_variants):
            rows.append(row)
            print(json.dumps(row), flush=True)
    write_result(args.out, {
        "benchmark": "attention_libraries",
        "command": " ".join(["python -m benchmarks.attention_libraries", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "commit": git_commit(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "flashinfer": package_version("flashinfer-python"),
        "copy_bandwidth_gb_s": round(copy_gb_s, 1),
        "flashinfer_build_s": round(build_s, 1),
        "rows": rows,
    })  # fmt: skip


if __name__ == "__main__":
    main()
