"""Split-K GEMM for the decode step's down projections: x @ W^T (+ bias), K >> N, few rows.

At decode batch sizes (M <= 64) a projection with K much larger than N has too few output
tiles to fill the GPU, so cuBLAS splits K and sums the splits in a second launch
(`splitKreduce_kernel`). Here the splits are summed inside the same launch: the program
that finishes a column tile's K splits last adds them up, so the reduce costs no launch.
Or the splits are left for the next kernel to sum (SplitKPartials): every program stores
its partial and exits, and the residual add after the projection (kernels/norms.py) reads
the splits instead of one output, which takes the arrival counter and the last program's
reduce off the step's path. Its epilogue can also serve LoRA adapters
(engine/models/lora.py): add each row's own adapter's delta (LoRADelta), or, for the
shrink before it, keep only each row's adapter's columns (RowGroups); and apply GPT-2's
tanh GELU after the bias, as cuBLASLt's GELU epilogue does (one rounding, of the
activation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.activation import gelu_tanh
from kernels.paged_attention import dot_precision
from kernels.pdl import launch_options, use_pdl, wait_previous
from kernels.splits import SplitKPartials

# Rows a workspace holds: the batch at which the kernel was measured to beat cuBLAS.
SPLITK_MAX_M = 64
# Up to this many rows every projection shape (not only K >> N) measured at or below cuBLAS
# (Llama-3-8B's and Qwen2.5-0.5B's, LM heads included, on an H100): a skinny product is a
# weight read, and one launch of this kernel reads the weights as fast as cuBLAS's
# GEMV-like kernels, without the separate split-K reduce cuBLAS adds to some.
SMALL_M = 16
# Outputs this wide (LM heads) fill the GPU with column tiles alone: wider tiles, deeper
# pipeline.
WIDE_N = 32768
# Up to this K (a small model's hidden size) a wide output's K tiles are half as long and
# its column tiles twice as wide: K = 896 makes 3.5 tiles of 256, too few to pipeline
# (Qwen2.5-0.5B's LM head, measured in the step on an H200).
SHORT_K = 1024
# Weights up to this size take the kernel up to SPLITK_MAX_M rows whatever their shape:
# their GEMMs are launch and ramp more than bytes, and this kernel, launched with PDL,
# reads its first weights while the kernel before it ends (GPT-2's projections, at most
# 4.7 MB, gained at batch 64, and so did Llama-3-8B's qkv and o, 48 and 32 MiB, in its
# step, though slower than cuBLAS alone; its 224 MiB gate_up stays with cuBLAS).
SMALL_WEIGHT_BYTES = 64 << 20


def linear_ref(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K], as nn.Linear stores it
    bias: torch.Tensor | None,  # [N]
) -> torch.Tensor:  # [M, N]
    return F.linear(x, weight, bias)


@dataclass(frozen=True)
class LoRADelta:
    """LoRA adapters' deltas for the kernel's epilogue to add (engine/models/lora.py):
    row m gets shrink[m] @ b over the `group` columns of its adapter ids[m] (-1: none)."""

    shrink: torch.Tensor  # [M, adapters * group]: x @ every adapter's A
    b: torch.Tensor  # [adapters * group, N]: their B, stacked
    ids: torch.Tensor  # [M] int64
    group: int
    masked: bool = False  # shrink's columns of other adapters than the row's are zero

    @property
    def num_adapters(self) -> int:
        return self.b.shape[0] // self.group


@dataclass(frozen=True)
class RowGroups:
    """Row m of a product keeps only columns [ids[m] * group, (ids[m] + 1) * group), the
    rest zero (ids[m] -1: none): a LoRA shrink keeping each token's adapter's columns."""

    ids: torch.Tensor  # [M] int64
    group: int


def keep_groups_ref(y: torch.Tensor, keep: RowGroups) -> torch.Tensor:
    columns = torch.arange(y.shape[1], device=y.device) // keep.group
    return y * (columns[None, :] == keep.ids[:, None])


def lora_delta_ref(delta: LoRADelta) -> torch.Tensor:  # [M, N]
    shrink = keep_groups_ref(delta.shrink, RowGroups(delta.ids, delta.group))
    return shrink.to(delta.b.dtype) @ delta.b


@triton.jit
def _splitk_linear_kernel(
    x_ptr,
    weight_ptr,
    scale_ptr,
    x_scale_ptr,
    bias_ptr,
    out_ptr,
    partials_ptr,
    counters_ptr,
    lora_shrink_ptr,
    lora_b_ptr,
    lora_ids_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_ps,
    stride_pm,
    lora_adapters,
    lora_group,
    FP8: tl.constexpr,  # x and W in e4m3, X = q * x_scale[m], W = q * scale[n]
    HAS_BIAS: tl.constexpr,
    LORA: tl.constexpr,  # add each row's adapter delta (LoRADelta)
    LORA_BLOCK: tl.constexpr,  # >= lora_group, a power of two >= 16
    KEEP_GROUP: tl.constexpr,  # row m keeps columns [ids[m], ids[m] + 1) * lora_group only
    GELU_TANH: tl.constexpr,  # the output is gelu_tanh(x @ W^T + bias)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DEFER: tl.constexpr,  # store each split's scaled product in partials_ptr, summed later
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program per (BLOCK_N output columns, K split): all M rows (padded to BLOCK_M >= 16
    # for tl.dot) times its columns of W, over its share of K, accumulated in fp32.
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_per_split = tl.cdiv(K, NUM_SPLITS * BLOCK_K) * BLOCK_K
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    # The first weight tile is read before waiting for x: under PDL, while the kernel
    # before this one finishes.
    ks = k_start + tl.arange(0, BLOCK_K)
    w = tl.load(
        weight_ptr + cols[None, :] * stride_wn + ks[:, None],
        mask=(cols[None, :] < N) & (ks[:, None] < k_end),
        other=0.0,
    )  # [BLOCK_K, BLOCK_N]
    wait_previous(PDL)
    x = tl.load(
        x_ptr + rows[:, None] * stride_xm + ks[None, :],
        mask=(rows[:, None] < M) & (ks[None, :] < k_end),
        other=0.0,
    )  # [BLOCK_M, BLOCK_K]
    acc = tl.dot(x, w, input_precision=DOT_PRECISION)
    for k in range(k_start + BLOCK_K, k_end, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :],
            mask=(rows[:, None] < M) & (ks[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            weight_ptr + cols[None, :] * stride_wn + ks[:, None],
            mask=(cols[None, :] < N) & (ks[:, None] < K),
            other=0.0,
        )
        acc += tl.dot(x, w, input_precision=DOT_PRECISION)

    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if DEFER:
        # SplitKPartials: scales and bias are linear in the sum, so each split applies
        # them to its own product (the bias once, in split 0's).
        if FP8:
            acc *= tl.load(scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
            acc *= tl.load(x_scale_ptr + rows, mask=rows < M, other=0.0)[:, None]
        if HAS_BIAS:
            bias = tl.load(bias_ptr + cols, mask=cols < tl.where(split == 0, N, 0), other=0.0)
            acc += bias.to(tl.float32)[None, :]
        part_offs = split * stride_ps + rows[:, None] * stride_pm + cols[None, :]
        tl.store(partials_ptr + part_offs, acc, mask=mask)
        return
    if NUM_SPLITS > 1:
        part_offs = rows[:, None] * stride_pm + cols[None, :]
        tl.store(partials_ptr + split * stride_ps + part_offs, acc, mask=mask)
        # Memory ordering, as CUTLASS's split-K semaphore: the CTA barrier makes every
        # thread's partial stores precede the atomic, whose release (gpu scope, cumulative)
        # publishes them to other SMs. The program that counts last acquires them through
        # the same atomic; the second barrier keeps all its threads' loads after that acquire.
        tl.debug_barrier()
        arrived = tl.atomic_add(counters_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived != NUM_SPLITS - 1:
            return
        tl.debug_barrier()
        # Summed in split order, not arrival order, so the result is deterministic.
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for s in tl.static_range(NUM_SPLITS):
            acc += tl.load(partials_ptr + s * stride_ps + part_offs, mask=mask, other=0.0)
        # Every split of this tile has arrived: reset for the next launch (graph replays
        # need no memset).
        tl.store(counters_ptr + pid_n, 0)
    if FP8:
        acc *= tl.load(scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
        acc *= tl.load(x_scale_ptr + rows, mask=rows < M, other=0.0)[:, None]
    if LORA:
        # Only the adapters some row of the tile uses: their shrink columns (zero for
        # the other rows) times their rows of B.
        ids = tl.load(lora_ids_ptr + rows, mask=rows < M, other=-1)
        js = tl.arange(0, LORA_BLOCK)
        for a in range(lora_adapters):
            if tl.max((ids == a).to(tl.int32), axis=0) > 0:
                first = a * lora_group
                shrink = tl.load(
                    lora_shrink_ptr
                    + rows[:, None] * (lora_adapters * lora_group)
                    + first
                    + js[None, :],
                    mask=(ids[:, None] == a) & (js[None, :] < lora_group),
                    other=0.0,
                )  # [BLOCK_M, LORA_BLOCK]
                lora_b = tl.load(
                    lora_b_ptr + (first + js[:, None]) * N + cols[None, :],
                    mask=(js[:, None] < lora_group) & (cols[None, :] < N),
                    other=0.0,
                )  # [LORA_BLOCK, BLOCK_N]
                acc += tl.dot(shrink.to(lora_b.dtype), lora_b, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if GELU_TANH:
        acc = gelu_tanh(acc)
    if KEEP_GROUP:  # a LoRA shrink: each row keeps its own adapter's columns
        ids = tl.load(lora_ids_ptr + rows, mask=rows < M, other=-1)
        acc = tl.where((cols[None, :] // lora_group) == ids[:, None], acc, 0.0)
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], out, mask=mask)


@dataclass(frozen=True)
class SplitKConfig:
    """Launch config; the default is the best measured at M=64 on an H100 (GPT-2's MLP
    down projection, Qwen2.5-0.5B's down_proj)."""

    num_splits: int = 4
    block_n: int = 32
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


class SplitKWorkspace:
    """The splits' fp32 partials and the per-column-tile arrival counters, allocated once
    for up to `max_m` rows of an N-column output (CUDA graphs: no per-call allocation).
    `config` launches up to SMALL_M rows, `rows_config` (default: the same) more.

    The counters start at zero and every launch leaves them at zero. One workspace serves
    one launch at a time: launches on one stream run one after another.
    """

    def __init__(
        self,
        n: int,
        device: torch.device,
        max_m: int = SPLITK_MAX_M,
        config: SplitKConfig = SplitKConfig(),
        rows_config: SplitKConfig | None = None,
    ) -> None:
        self.n = n
        self.max_m = max_m
        self.configs = (config, config if rows_config is None else rows_config)
        splits = max(c.num_splits for c in self.configs)
        # [num_splits, max_m, n]; unused with one split, so it shrinks to one element.
        shape = (splits, max_m, n) if splits > 1 else (1, 1, 1)
        self.partials = torch.empty(shape, dtype=torch.float32, device=device)
        num_col_tiles = triton.cdiv(n, min(c.block_n for c in self.configs))
        self.counters = torch.zeros(num_col_tiles, dtype=torch.int32, device=device)

    def config_for(self, m: int) -> SplitKConfig:
        return self.configs[m > SMALL_M]


_SHARED: dict[tuple[int, torch.device, bool, bool], SplitKWorkspace] = {}


def splitk_configs(
    n: int, k: int, fp8: bool, sms: int, hopper: bool
) -> tuple[SplitKConfig, SplitKConfig]:
    """The launch configs of an N-column output, K deep, up to SMALL_M rows and past
    them, on a GPU of `sms` SMs. Up to SMALL_M rows of 16-bit weights its K splits fill
    about four waves of the SMs with column tiles (wide outputs need none; their tiles
    follow K by SHORT_K). More rows (a down projection at batch 64) make each tile a real
    GEMM: about one wave, wider tiles for wide outputs and a deeper pipeline (measured at
    m = 64 on Llama-3-8B's and Qwen2.5-0.5B's down projections; the fifth stage on
    Llama-3-8B's in its step), except that a short K keeps 32-wide tiles. FP8 weights
    take that config at any row count, with K tiles of 256 one-byte values: 5 stages
    where the column tiles leave SMs to the splits, 3 where they alone fill more than a
    wave (the tiles measured on Llama-3-8B's four projections at m = 32 and 64, and at 1
    and 16 on an H200; the fifth stage at 16 and 64, and in its decode step at batch 1
    and 64)."""
    short = 0 < k <= SHORT_K
    if n >= WIDE_N:
        block_n, block_k = (128, 128) if short else (64, 256)
        config = SplitKConfig(1, block_n, block_k, num_stages=4)
        return config, config
    block_n = 64 if n >= 2048 else 32
    if short and not fp8 and triton.cdiv(n, 32) <= sms:
        # A split of a short K is a tile or two, less than the last program's reduce:
        # twice the column tiles instead (GPT-2's qkv, in its step).
        block_n = 32
    tiles = triton.cdiv(n, block_n)
    splits = max(1, min(4, sms // tiles))
    if fp8:
        rows = SplitKConfig(splits, block_n, block_k=256, num_stages=3 if tiles > sms else 5)
        return rows, rows
    small_tiles = triton.cdiv(n, SplitKConfig.block_n)
    config = SplitKConfig(num_splits=max(1, min(4, -(-4 * sms // small_tiles))))
    # 5 stages of 64-row tiles take 192 KB of shared memory (4 take 160): a Hopper program
    # may take 227 KB, an A100's 163.
    rows = SplitKConfig(splits, block_n, num_stages=5 if hopper else 4)
    return config, rows


def splitk_workspace(
    n: int, device: torch.device, fp8: bool = False, k: int = 0
) -> SplitKWorkspace:
    """One workspace per output width (and weight dtype, and K short or not:
    `splitk_configs`), shared by every layer of that width: launches on one stream run
    one after another, and each leaves the counters at zero."""
    key = (n, device, fp8, 0 < k <= SHORT_K)
    if key not in _SHARED:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        hopper = torch.cuda.get_device_capability(device) >= (9, 0)
        config, rows = splitk_configs(n, k, fp8, sms, hopper)
        _SHARED[key] = SplitKWorkspace(n, device, config=config, rows_config=rows)
    return _SHARED[key]


def splitk_linear(
    x: torch.Tensor,  # [M, K], last dim contiguous
    weight: torch.Tensor,  # [N, K], last dim contiguous
    bias: torch.Tensor | None,  # [N]
    workspace: SplitKWorkspace,
    weight_scale: torch.Tensor | None = None,  # [N] fp32, with FP8 (e4m3) x and weights
    x_scale: torch.Tensor | None = None,  # [M] or [M, 1] fp32, with weight_scale
    out_dtype: torch.dtype | None = None,  # with FP8: the model dtype
    lora: LoRADelta | None = None,  # adapters' deltas added in the epilogue
    keep: RowGroups | None = None,  # zero each row's columns outside its group
    defer: bool = False,  # leave a split launch's splits unsummed (SplitKPartials)
    gelu: bool = False,  # tanh GELU after the bias (gelu_tanh_linear_ref)
) -> torch.Tensor | SplitKPartials:  # [M, N] in x's dtype (out_dtype with FP8)
    """Triton version of `linear_ref` for M <= workspace.max_m; one launch, no host sync.
    With weight_scale and x_scale, x and the weight are e4m3 (x quantized per token,
    the weight per output channel: `fp8_linear_ref`'s product), the weights read at one
    byte each. On tiles of 64 rows (33 to 64) the dots run on e4m3 (wgmma); on smaller
    ones Triton widens both tiles to fp16 for mma.sync, as wgmma needs 64 rows of A
    (swapping the operands to put the weight's rows there measured slower at batch 1).
    (Upcasting e4m3 weights for x in the model dtype instead costs more in conversions
    than quantizing x does.) With `defer`, a launch of several splits returns them
    unsummed, for `add_norm` to sum (not with adapters' deltas or row groups)."""
    (m, k), n = x.shape, weight.shape[0]
    assert weight.shape[1] == k and n == workspace.n and m <= workspace.max_m
    assert x.stride(1) == 1 and weight.stride(1) == 1
    fp8 = weight_scale is not None
    assert (x_scale is not None) == fp8 and (out_dtype is not None) == fp8
    assert x.dtype == weight.dtype
    assert weight.numel() < 2**31  # int32 offsets
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out
    config, partials = workspace.config_for(m), workspace.partials
    defer = defer and config.num_splits > 1 and lora is None and keep is None and not gelu
    if defer:  # its own buffer: the shared workspace's may be rewritten before the sum
        partials = torch.empty(config.num_splits, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, config.block_n), config.num_splits)
    pdl = use_pdl(x.device)
    if lora is not None:  # contiguous: the kernel computes their offsets from the shapes
        assert lora.shrink.is_contiguous() and lora.b.is_contiguous() and lora.b.shape[1] == n
    assert lora is None or keep is None  # one use of the ids and group per launch
    by_row = lora or keep  # the per-row adapter ids and column group the epilogue reads
    ids, group = (weight, 1) if by_row is None else (by_row.ids, by_row.group)
    _splitk_linear_kernel[grid](
        x,
        weight,
        weight if weight_scale is None else weight_scale,
        weight if x_scale is None else x_scale,
        weight if bias is None else bias,
        out,
        partials,
        workspace.counters,
        weight if lora is None else lora.shrink,
        weight if lora is None else lora.b,
        ids,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        partials.stride(0),
        partials.stride(1),
        0 if lora is None else lora.num_adapters,
        group,
        FP8=fp8,
        HAS_BIAS=bias is not None,
        LORA=lora is not None,
        LORA_BLOCK=16 if lora is None else max(16, triton.next_power_of_2(lora.group)),
        KEEP_GROUP=keep is not None,
        GELU_TANH=gelu,
        BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        NUM_SPLITS=config.num_splits,
        DEFER=defer,
        DOT_PRECISION=dot_precision(x.dtype),
        PDL=pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(pdl),
    )
    return SplitKPartials(partials, out.dtype) if defer else out


def splitk_pays(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `splitk_linear` should replace cuBLAS for this call: the dispatch the other
    kernels make once per device (`*_for(device)`), made per call since M changes per step.
    K >= 2N (down projections) or weights up to SMALL_WEIGHT_BYTES (not vocabulary-wide):
    up to SPLITK_MAX_M rows, measured at M = 64 on GPT-2's and Qwen2.5-0.5B's; any other
    shape up to SMALL_M rows (docs/kernels.md)."""
    return (
        x.is_cuda
        and x.dtype in (torch.float16, torch.bfloat16)
        and x.dim() == 2
        and x.stride(1) == 1
        and weight.dtype == x.dtype
        and weight.stride(1) == 1
        and weight.numel() < 2**31  # the kernel's offsets are int32
        and x.shape[0] <= splitk_max_rows(*weight.shape, weight.element_size())
    )


def splitk_max_rows(n: int, k: int, element_size: int) -> int:
    """Rows up to which a [n, k] weight takes the split-K kernel (splitk_pays)."""
    small = n < WIDE_N and n * k * element_size <= SMALL_WEIGHT_BYTES
    return SPLITK_MAX_M if k >= 2 * n or small else SMALL_M


def dense(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    defer: bool = False,
    gelu: bool = False,
) -> torch.Tensor | SplitKPartials:
    """x @ weight^T + bias, through the split-K kernel where it pays, else cuBLAS. With
    `defer` a split launch returns its splits unsummed (for `add_norm`). With `gelu` (CUDA
    only, a bias given) the tanh GELU of it in the same launch, rounded once: the
    kernel's epilogue, else cuBLASLt's (`gelu_tanh_linear_ref`)."""
    if x.dim() == 2 and splitk_pays(x, weight):
        workspace = splitk_workspace(weight.shape[0], x.device, k=weight.shape[1])
        return splitk_linear(x, weight, bias, workspace, defer=defer, gelu=gelu)
    if gelu:
        return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
    return F.linear(x, weight, bias)


def gelu_tanh_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """tanh GELU of x @ weight^T + bias, rounded once (cuBLASLt's GELU epilogue)."""
    y = F.linear(x.float(), weight.float(), bias.float())
    return F.gelu(y, approximate="tanh").to(x.dtype)
