"""The mixture-of-experts layer: top-k routing and the experts' stacked weights, run by
kernels/fused_moe.py (and kernels/moe_gemv.py at decode batch sizes)."""

from __future__ import annotations

import torch
from torch import nn

from engine.distributed import SINGLE, TensorParallel
from engine.models.parallel import TensorSlice, WeightSlice, check_shape, read, split
from engine.models.weight_copy import fill, fill_quantized
from kernels.activation import ExpertAct, expert_gated
from kernels.fp8 import FP8_DTYPE, quantize_per_channel
from kernels.fused_moe import ExpertBiases, ExpertScales, fused_moe_for
from kernels.moe_routing import select_experts_for


class FusedMoE(nn.Module):
    """Top-k routed gated experts, their weights stacked: w13 [num_experts, 2 * inter, hidden]
    (gate rows, then up rows) and w2 [num_experts, hidden, inter]. SiLU by default; GPT-OSS
    has biases on the router and both projections (b13, b2) and a ClampedSwiGLU, Gemma 4
    a GeluTanhGLU (`act`); Nemotron 3's experts are ungated (Relu2: w13 holds inter rows,
    the up projection's, section 0).

    Tensor-parallel: every expert's intermediate dim is split (w13 column-parallel, w2
    row-parallel), the router replicated; one all_reduce sums the ranks' outputs.

    `quantize_fp8` turns w13 and w2 into e4m3 buffers with per-(expert, row) scales
    (w13_scale, w2_scale), as `--quantization fp8` does the dense projections; after
    `quantize_at_load` they are e4m3 from the start, quantized as they load."""

    def __init__(
        self,
        hidden: int,
        inter: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        tp: TensorParallel = SINGLE,
        bias: bool = False,
        act: ExpertAct | None = None,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.tp = tp
        self.act = act
        self.inter = split(inter, tp, "moe_intermediate_size")  # this rank's share
        local = self.inter.local_size
        rows = (2 if expert_gated(act) else 1) * local  # w13's: gate and up, or one
        self.gate = nn.Linear(hidden, num_experts, bias=bias)  # the router
        self.w13 = nn.Parameter(torch.empty(num_experts, rows, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, local))
        self.b13 = self.b2 = None
        self.scales: ExpertScales | None = None
        self.load_dtype: torch.dtype | None = None  # quantize_at_load's
        if bias:
            self.b13 = nn.Parameter(torch.empty(num_experts, rows))
            self.b2 = nn.Parameter(torch.empty(num_experts, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        route = select_experts_for(x.device)
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        return self.routed(x, weights, ids)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The experts' weighted sum for routing already chosen (weights, ids: [num_tokens,
        top_k]), summed over the ranks: the families that route their own way call this."""
        biases = None if self.b13 is None else ExpertBiases(self.b13, self.b2)
        moe = fused_moe_for(x.device)
        out = moe(x, self.w13, self.w2, weights, ids, biases, self.act, self.scales)
        return self.tp.all_reduce(out)

    def quantize_at_load(self, dtype: torch.dtype) -> None:
        """w13 and w2 in e4m3 from the start (on the meta device, before the model is
        materialized) with their scales: load_shard quantizes each expert's rows as they
        arrive, from `dtype`, as quantize_fp8 would after loading them, so the experts
        never take dtype's memory on the device (an FP8 DeepSeek-V3's 656B expert
        weights would not fit eight 141 GB GPUs in bf16)."""
        self.load_dtype = dtype
        for name in ("w13", "w2"):
            shape = getattr(self, name).shape
            q = torch.empty(shape, dtype=FP8_DTYPE, device="meta")
            setattr(self, name, nn.Parameter(q, requires_grad=False))
            scale = torch.empty(shape[:2], dtype=torch.float32, device="meta")
            self.register_buffer(f"{name}_scale", scale)

    @torch.no_grad()
    def quantize_fp8(self) -> None:
        """w13 and w2 to e4m3, one scale per expert and output row; expert by expert, so
        the fp32 temporaries stay one expert's size. Buffers, as Fp8Linear's."""
        if self.w13.dtype == FP8_DTYPE:  # quantized as they loaded (quantize_at_load)
            self.scales = ExpertScales(self.w13_scale, self.w2_scale)
            return
        for name in ("w13", "w2"):
            w = getattr(self, name).data
            q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
            scale = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
            for expert in range(w.shape[0]):
                q[expert], scale[expert] = quantize_per_channel(w[expert])
            delattr(self, name)
            self.register_buffer(name, q)
            self.register_buffer(f"{name}_scale", scale)
        self.scales = ExpertScales(self.w13_scale, self.w2_scale)

    def load_shard(self, leaf: str, weight: WeightSlice, section: tuple[int, int | None]) -> None:
        """One expert's HF tensor: section (expert, 0 gate / 1 up) into w13 or b13,
        (expert, None) into w2 or b2; this rank's rows (w13, b13) or columns (w2) of it.
        b2 is added once: rank 0 holds it, the others zeros (as RowParallelLinear's)."""
        expert, half = section
        local, hidden = self.inter.local_size, self.w2.shape[1]
        if leaf == "b2":
            b2 = read(weight, [hidden])
            self.b2.data[expert].copy_(b2 if self.tp.is_driver else torch.zeros_like(b2))
        elif leaf == "b13":
            b13 = read(weight, [self.inter.size], self.inter.ranges)
            fill(self.b13.data[expert, half * local : (half + 1) * local], b13)
        elif half is None:
            w2 = read(weight, [hidden, self.inter.size], self.inter.ranges, dim=1)
            self._store("w2", (expert,), w2)
        else:
            w13 = read(weight, [self.inter.size, hidden], self.inter.ranges)
            self._store("w13", (expert, slice(half * local, (half + 1) * local)), w13)

    @torch.no_grad()
    def _store(self, name: str, index: tuple, rows: torch.Tensor) -> None:
        """rows into w13 or w2 at index; in e4m3 with their scales after quantize_at_load."""
        dst = getattr(self, name).data
        if dst.dtype != FP8_DTYPE:
            fill(dst[index], rows)
            return
        fill_quantized(dst[index], getattr(self, f"{name}_scale")[index], rows, self.load_dtype)


def load_stacked(moe: FusedMoE, ours: str, weight: WeightSlice, transposed: bool) -> None:
    """Experts stacked in one tensor, gate and up concatenated (not interleaved, as
    GPT-OSS's are): w13 [experts, 2 * inter, hidden] and w2 [experts, hidden, inter], or
    each expert's matrix transposed (Qwen3-VL-MoE's published checkpoints). Expert by
    expert; load_shard takes this rank's rows or columns."""
    num_experts, hidden, inter = moe.w2.shape[0], moe.w2.shape[1], moe.inter.size
    rows, cols = (2 * inter, hidden) if ours == "w13" else (hidden, inter)
    check_shape(weight, [num_experts, cols, rows] if transposed else [num_experts, rows, cols])
    for e in range(num_experts):
        matrix = weight[e : e + 1][0]
        matrix = matrix.t() if transposed else matrix
        if ours == "w2":
            moe.load_shard("w2", TensorSlice(matrix), (e, None))
        else:
            moe.load_shard("w13", TensorSlice(matrix[:inter]), (e, 0))
            moe.load_shard("w13", TensorSlice(matrix[inter:]), (e, 1))
