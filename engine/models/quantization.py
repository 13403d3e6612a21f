"""FP8 weights: the dense projections quantized at load (`--quantization fp8`), and
checkpoints published in FP8 read back to the model dtype.

A checkpoint in FP8 is dequantized as it streams in (each fp8 `weight` times its
scale), so every model's own `load_weights` sees plain tensors; on CUDA the dense
projections are then quantized per output channel, as for a bf16 checkpoint. Per-channel
and per-tensor scales survive that round trip (the fp8 values come back the same, the
scale to within bf16's rounding); block-wise ones become per-channel. MoE experts go to
e4m3 per expert and output row (`FusedMoE.quantize_fp8`); the router, the embeddings
and the LM head stay in the model dtype.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from engine.distributed import TensorParallel
from engine.models.experts import FusedMoE
from engine.models.layers import PagedAttention
from engine.models.parallel import ColumnParallelLinear, RowParallelLinear, TensorSlice, WeightSlice
from kernels.fp8 import (
    FP8_DTYPE,
    Fp8Rows,
    fp8_rows_linear_for,
    quantize_per_channel,
    quantize_per_token_for,
    scaled_mm_fits,
)
from kernels.linear import SPLITK_MAX_M, LoRADelta, splitk_linear, splitk_workspace
from kernels.splits import SplitKPartials

# Linear layers quantized by `quantize_model`: exactly these types, so that a subclass
# with a forward of its own is never silently replaced. A row-parallel layer's
# all_reduce follows its FP8 GEMM.
DENSE_LINEARS = (nn.Linear, ColumnParallelLinear, RowParallelLinear)


class Fp8Linear(nn.Module):
    """y = x W^T + b with W in e4m3 and one fp32 scale per output row (W ~ weight *
    weight_scale[:, None]); x is quantized per token on the fly. Buffers, not
    parameters: `model.parameters()` keeps answering the model dtype."""

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        reduce: TensorParallel | None = None,  # a row-parallel shard: sum over the ranks
    ):
        super().__init__()
        self.reduce = reduce
        self.lora: nn.Module | None = None  # LoRA adapters' deltas, in the model dtype
        self.sum_later = False  # RowParallelLinear's: splits left for the residual add
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)  # [N, K] e4m3, contiguous
        self.register_buffer("weight_scale", weight_scale)  # [N] fp32
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        if linear.weight.dtype == FP8_DTYPE:  # quantized as it loaded
            weight, scale = linear.weight.data, linear.weight_scale
        else:
            weight, scale = quantize_per_channel(linear.weight.data)
        bias = None if linear.bias is None else linear.bias.data
        reduce = linear.tp if isinstance(linear, RowParallelLinear) else None
        fp8 = cls(weight.contiguous(), scale, bias, reduce)
        fp8.lora = getattr(linear, "lora", None)
        fp8.sum_later = getattr(linear, "sum_later", False)
        return fp8

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor | SplitKPartials:
        """x: rows in the model dtype, or already quantized by the kernel before
        (`quantize_model` wires the norms and activations that do so)."""
        defer = self.sum_later and (self.reduce is None or self.reduce.size == 1)
        # (Not isinstance(x, Fp8Rows): the kernel tests reload kernels/fp8.py, class and all.)
        if isinstance(x, torch.Tensor):
            rows = x.reshape(-1, x.shape[-1])
            quantized = Fp8Rows(*quantize_per_token_for(rows.device)(rows), rows.dtype)
            # An adapter's shrink reads x unquantized (its producer leaves it so).
            delta = None if self.lora is None else self.lora.delta(rows)
            out = self.rows_forward(quantized, delta, defer)
            if isinstance(out, torch.Tensor):
                out = out.view(*x.shape[:-1], self.out_features)
        else:
            out = self.rows_forward(x, defer=defer)
        return out if self.reduce is None or defer else self.reduce.all_reduce(out)

    def rows_forward(
        self, x: Fp8Rows, lora: LoRADelta | None = None, defer: bool = False
    ) -> torch.Tensor | SplitKPartials:
        if x.q.is_cuda and x.q.shape[0] <= SPLITK_MAX_M:
            # Decode batches: the split-K kernel reads each weight's byte once, where
            # _scaled_mm's kernels for skinny products fall far short of that. Its dots
            # run on e4m3 at every batch: upcasting the weights instead, for x left in
            # the model dtype, costs more in conversions than quantizing x does.
            workspace = splitk_workspace(self.out_features, x.q.device, fp8=True)
            return splitk_linear(
                x.q,
                self.weight,
                self.bias,
                workspace,
                self.weight_scale,
                x.scale,
                x.dtype,
                lora,
                defer=defer,
            )
        out = fp8_rows_linear_for(x.q.device)(x, self.weight, self.weight_scale, self.bias)
        return out if lora is None else self.lora.add(lora, out)


def fp8_targets(model: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Module]]:
    """(parent, name, module) of what `--quantization fp8` quantizes: MoE experts (a
    FusedMoE, yielded as its own parent with name "") and the dense projections (qkv/o/
    gate_up/down; GPT-2's four). Skipped: MoE routers, and shapes `_scaled_mm` cannot take."""
    for parent in list(model.modules()):
        if isinstance(parent, FusedMoE):
            yield parent, "", parent
            continue  # its Linears route (or gate a shared expert): tiny, and sensitive
        for name, child in list(parent.named_children()):
            if type(child) in DENSE_LINEARS and scaled_mm_fits(
                child.in_features, child.out_features
            ):
                yield parent, name, child


def quantize_linears_at_load(model: nn.Module, dtype: torch.dtype) -> None:
    """On the meta model, before it is materialized: each of `fp8_targets`' weights in
    e4m3 from the start, with a fp32 scale a row beside it (`weight_scale`; the experts'
    `w13_scale`, `w2_scale`). Loading quantizes the rows as they arrive, from `dtype`
    (`parallel.fill_rows`), so no projection takes the model dtype's memory on the
    device: a 70B model in FP8 loads on one GPU that its bf16 weights would overflow."""
    for _, _, module in fp8_targets(model):
        if isinstance(module, FusedMoE):
            module.quantize_at_load(dtype)
            continue
        q = torch.empty(module.weight.shape, dtype=FP8_DTYPE, device="meta")
        module.weight = nn.Parameter(q, requires_grad=False)
        scale = torch.empty(module.out_features, dtype=torch.float32, device="meta")
        module.register_buffer("weight_scale", scale)
        module.load_dtype = dtype


@torch.no_grad()
def quantize_model(model: nn.Module) -> int:
    """Replace the dense projections by Fp8Linear and make MoE experts FP8 (two
    projections a layer; `fp8_targets`); returns how many projections.
    Then each producer a module's FP8_FEEDS names (a norm, an MLP's activation) whose
    consumers (one, or a tuple reading the same rows) all went FP8 quantizes its output
    itself (`fp8_out`): one quantizer launch fewer for each consumer."""
    count = 0
    for parent, name, module in fp8_targets(model):
        if isinstance(module, FusedMoE):
            module.quantize_fp8()
            count += 2
        else:
            setattr(parent, name, Fp8Linear.from_linear(module))
            count += 1
    for module in model.modules():
        for producer, consumers in getattr(module, "FP8_FEEDS", {}).items():
            names = (consumers,) if isinstance(consumers, str) else consumers
            try:
                linears = [module.get_submodule(name) for name in names]
            except AttributeError:  # a layer without that consumer (an MoE block's MLP)
                continue
            # A LoRA delta reads the consumer's input in the model dtype.
            fp8 = all(isinstance(x, Fp8Linear) and x.lora is None for x in linears)
            module.get_submodule(producer).fp8_out = fp8
    return count


@dataclass(frozen=True)
class Fp8Checkpoint:
    """How a checkpoint stores its FP8 weights (from config.json's quantization_config)."""

    scale_names: tuple[str, ...]  # the scale tensor beside each fp8 `weight`
    block_size: tuple[int, int] | None  # block-wise scales; None: per channel or tensor


SUPPORTED = (
    'quant_method "fp8" (float8 weight + weight_scale_inv or weight_scale, block-wise or '
    "per-tensor), "
    '"compressed-tensors" with 8-bit float weights (strategy channel, tensor or block), '
    'and GPT-OSS\'s "mxfp4" experts'
)
CT_FORMATS = ("float-quantized", "naive-quantized")


def checkpoint_fp8(hf_config) -> Fp8Checkpoint | None:
    """The checkpoint's FP8 layout, None if it is not quantized; ValueError naming any
    other scheme."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict()
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("scale_fmt", "float") != "float":
            raise ValueError(f"unsupported fp8 scale_fmt {qc['scale_fmt']!r} (only float)")
        block = qc.get("weight_block_size")
        # transformers names the scale weight_scale_inv; AutoFP8's older per-tensor
        # checkpoints, with the same quant_method, weight_scale. Both multiply.
        scales = ("weight_scale_inv", "weight_scale")
        return Fp8Checkpoint(scales, tuple(block) if block else None)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "mxfp4" and hf_config.model_type == "gpt_oss":
        return None  # its experts, which gpt_oss.py dequantizes as it loads them
    raise ValueError(
        f"unsupported quantization scheme quant_method={method!r}; supported: {SUPPORTED}"
    )


def _compressed_tensors(qc: dict) -> Fp8Checkpoint:
    fmt = qc.get("format")
    if fmt not in CT_FORMATS:
        raise ValueError(
            f"unsupported compressed-tensors format {fmt!r} (supported: {', '.join(CT_FORMATS)})"
        )
    blocks = set()
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if _bits(w) != "8-bit float" or w.get("strategy") not in ("channel", "tensor", "block"):
            raise ValueError(
                f"unsupported compressed-tensors scheme in config_groups.{name}: {_bits(w)} "
                f"weights, strategy {w.get('strategy')}; supported: {SUPPORTED}"
            )
        acts = group.get("input_activations")
        if acts and _bits(acts) != "8-bit float":
            raise ValueError(
                f"unsupported compressed-tensors input_activations in config_groups.{name}: "
                f"{_bits(acts)} (only 8-bit float)"
            )
        if w.get("strategy") == "block":
            blocks.add(tuple(w.get("block_structure") or ()))
    kv = qc.get("kv_cache_scheme")
    if kv and _bits(kv) != "8-bit float":
        raise ValueError(
            f"unsupported compressed-tensors kv_cache_scheme: {_bits(kv)} (only 8-bit float)"
        )
    if len(blocks) > 1:
        raise ValueError(f"compressed-tensors groups with different block structures {blocks}")
    block = blocks.pop() if blocks else None
    return Fp8Checkpoint(("weight_scale",), block or None)


def _bits(scheme: dict) -> str:
    return f"{scheme.get('num_bits')}-bit {scheme.get('type')}"


def dequantize_weight(
    weight: torch.Tensor,  # [N, K] e4m3
    scale: torch.Tensor,  # [] / [1] per tensor, [N] / [N, 1] per channel, [N/bn, K/bk] per block
    block_size: tuple[int, int] | None,
) -> torch.Tensor:  # [N, K] fp32
    w = weight.float()
    scale = scale.float()
    if scale.numel() == 1:
        return w * scale.reshape(())
    if block_size is not None and scale.dim() == 2 and scale.shape[1] > 1:
        bn, bk = block_size
        n, k = w.shape
        full = scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
        return w * full
    if scale.numel() == w.shape[0]:
        return w * scale.reshape(-1, 1)
    raise ValueError(f"scale of shape {tuple(scale.shape)} does not fit a weight {tuple(w.shape)}")


# Static activation scales: activations are quantized per token instead.
DROPPED_SUFFIXES = (".input_scale", ".activation_scale", ".weight_zero_point")
KV_SCALE = re.compile(r"\.(\d+)\..*\.([kv])_scale$")


def dequantize_checkpoint(
    weights: Iterable[tuple[str, WeightSlice]],
    scheme: Fp8Checkpoint,
    kv_scales: dict[int, dict[str, float]],  # filled: layer -> {"k": s, "v": s}
) -> Iterator[tuple[str, WeightSlice]]:
    """The checkpoint's tensors with each fp8 `weight` multiplied by its scale (fp32),
    scales and static activation scales dropped, k/v cache scales collected. Each
    tensor is read whole (a block's scale spans the ranks' slices)."""
    waiting: dict[str, torch.Tensor] = {}  # module prefix -> its fp8 weight or its scale
    scale_suffixes = tuple("." + s for s in scheme.scale_names)
    for name, unread in weights:
        tensor = unread[...]
        kv = KV_SCALE.search(name)
        if kv:
            kv_scales.setdefault(int(kv.group(1)), {})[kv.group(2)] = float(tensor.float())
            continue
        if name.endswith(DROPPED_SUFFIXES):
            continue
        is_weight = name.endswith(".weight") and tensor.dtype == FP8_DTYPE
        if not is_weight and not name.endswith(scale_suffixes):
            yield name, TensorSlice(tensor)
            continue
        prefix = name.rpartition(".")[0]
        other = waiting.pop(prefix, None)
        if other is None:  # the first of the pair: it waits for the other
            waiting[prefix] = tensor
            continue
        weight, scale = (tensor, other) if is_weight else (other, tensor)
        yield f"{prefix}.weight", TensorSlice(dequantize_weight(weight, scale, scheme.block_size))
    weights = sorted(p for p, t in waiting.items() if t.dtype == FP8_DTYPE)[:3]
    if weights:
        scale = " or ".join(scheme.scale_names)
        raise ValueError(f"fp8 weights without their {scale}: {', '.join(weights)}")
    if waiting:
        raise ValueError(f"weight scales without an fp8 weight: {', '.join(sorted(waiting)[:3])}")


def set_kv_scales(model: nn.Module, kv_scales: dict[int, dict[str, float]]) -> None:
    """Give each attention layer its checkpoint's k/v cache scales (1.0 where none)."""
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    for i, layer in enumerate(layers):
        scales = kv_scales.get(i, {})
        layer.k_scale = scales.get("k", 1.0)
        layer.v_scale = scales.get("v", 1.0)


# The 16 values of an e2m1 (FP4) nibble, by its bits: sign, two exponent bits, one mantissa.
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def dequantize_mxfp4(
    blocks: torch.Tensor,  # [..., groups, 16] uint8: 32 e2m1 values a group, low nibble first
    scales: torch.Tensor,  # [..., groups] uint8: each group's power of two, biased by 127
) -> torch.Tensor:  # [..., groups * 32] fp32, exactly the values encoded
    """The OCP microscaling FP4 format as GPT-OSS's checkpoints store it (transformers'
    `convert_moe_packed_tensors`, without its transpose)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    blocks = blocks.to(torch.uint8)
    values = torch.stack([lut[(blocks & 0x0F).int()], lut[(blocks >> 4).int()]], dim=-1)
    values = values.flatten(-2)  # [..., groups, 32]
    values = values * torch.exp2(scales.float() - 127)[..., None]
    return values.flatten(-2)
