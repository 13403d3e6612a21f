"""LoRA adapters (PEFT checkpoints) served beside the base model, any mix per batch.

Adapter a adds scale_a * (x A_a^T) B_a^T to a projection's output. Every adapter's A
and B are stacked once, at load, rank padded to the largest (R), for each projection
they touch (k sections: q, k, v of a fused qkv_proj each have their own A and B):

    shrink = x @ A_all                 [tokens, L * k * R]  every adapter at once
    shrink *= mask                     each token keeps its own adapter's columns
    y += shrink @ B_all                [L * k * R, out]: B_a's rows where a section lands

The mask comes from each token's adapter index (-1: none), staged with the step's
inputs, so the same kernels run under a CUDA graph whatever the batch's mix. At decode
batch sizes the shrink's split-K kernel applies it in its epilogue, and the
projection's split-K kernel adds the expand in its own, reading only the B of adapters
its rows use: one launch more than the projection. Products past the split-K kernel's
rows add the expand in torch (an addmm; the mask, where the shrink did not apply it,
built once a step).

With tensor parallelism, a column-parallel projection holds every A and its rows of B;
a row-parallel one its columns of A and every B: its delta is a partial sum, added
before the projection's all_reduce like the rest of its product.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from engine.models.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    Section,
    TensorSlice,
    read,
)
from kernels.linear import (
    LoRADelta,
    RowGroups,
    SplitKConfig,
    SplitKWorkspace,
    dense,
    splitk_linear,
    splitk_pays,
    splitk_workspace,
)

# adapter_config.json settings that change what an adapter computes, which this code
# does not apply: refused by name rather than served wrong. (layers_to_transform needs
# nothing: the adapter holds those layers' tensors only.)
UNSUPPORTED = {
    "use_dora": "DoRA",
    "lora_bias": "LoRA biases",
    "alpha_pattern": "per-module lora_alpha (alpha_pattern)",
    "modules_to_save": "modules_to_save (fully trained modules)",
    "target_parameters": "LoRA on parameters (target_parameters)",
}


class LoRAError(ValueError):
    """An adapter that cannot be served, and why."""


@dataclass(frozen=True)
class AdapterWeights:
    """One adapter's A [r, in] and B [out, r] per PEFT module name (without the
    `base_model.model.` prefix), B already multiplied by the adapter's scale."""

    name: str
    rank: int
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_adapter(name: str, path: str) -> AdapterWeights:
    """A PEFT LoRA directory (adapter_config.json, adapter_model.safetensors), checked."""
    root = Path(path)
    try:
        config = json.loads((root / "adapter_config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAError(f"LoRA adapter {name!r}: cannot read its adapter_config.json: {e}") from e
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {config['peft_type']!r} is not LORA")
    for key, what in UNSUPPORTED.items():
        if config.get(key):
            raise LoRAError(f"LoRA adapter {name!r}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"LoRA adapter {name!r}: bias={config['bias']!r} is not supported")
    file = root / "adapter_model.safetensors"
    if not file.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: no {file}")
    tensors = load_file(file)
    alpha, rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora"))
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key in tensors:
        module, _, leaf = key.removeprefix("base_model.model.").rpartition(".lora_")
        if leaf != "A.weight":
            if leaf != "B.weight":
                raise LoRAError(f"LoRA adapter {name!r}: unsupported tensor {key!r}")
            continue
        a = tensors[key].float()
        b = tensors.get(key.replace(".lora_A.", ".lora_B."))
        if b is None or a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise LoRAError(f"LoRA adapter {name!r}: {module} has no matching lora_B")
        r = a.shape[0]  # its own rank: rank_pattern may set it per module
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        modules[module] = (a, b.float() * scale)
    if not modules:
        raise LoRAError(f"LoRA adapter {name!r}: no LoRA weights in {file}")
    rank = max(a.shape[0] for a, _ in modules.values())
    return AdapterWeights(name, rank, modules)


class LoRAState:
    """The step's adapter of each token, and the masks every LoRA layer reads: one per
    section count k, built at its first use in a forward (the model runner calls
    `begin` first, also inside a captured graph)."""

    def __init__(self, slots: int, rank: int, dtype: torch.dtype, device: torch.device):
        self.slots = slots  # adapter indices 0 .. slots - 1 (engine/models/lora_slots.py)
        self.rank, self.dtype, self.device = rank, dtype, device
        self.ids: torch.Tensor | None = None  # [num_tokens] adapter index, -1: none
        self._columns: dict[int, torch.Tensor] = {}
        self._masks: dict[int, torch.Tensor] = {}
        self._shrink_workspaces: dict[tuple[int, int], SplitKWorkspace] = {}

    def shrink_workspace(self, width: int, k: int) -> SplitKWorkspace:
        """The split-K workspace of shrinks to `width` columns from k inputs (shared by the
        layers of that shape). A shrink is all K and next to no N: more K splits than a
        projection's, up to 16 rows, so its few column tiles fill more SMs (measured on
        Llama-3-8B's widths and K of 4,096 and 14,336); beyond 16 rows, eight."""
        key = (width, k)
        if key not in self._shrink_workspaces:
            few = SplitKConfig(num_splits=min(32, max(8, k // 256)), block_n=32, block_k=128)
            many = SplitKConfig(num_splits=8, block_n=32, block_k=128)
            workspace = SplitKWorkspace(width, self.device, config=few, rows_config=many)
            self._shrink_workspaces[key] = workspace
        return self._shrink_workspaces[key]

    def columns(self, k: int) -> torch.Tensor:
        """[L * k * R] the adapter each stacked column belongs to (shared by layers)."""
        if k not in self._columns:
            width = self.slots * k * self.rank
            cols = torch.arange(width, device=self.device)
            self._columns[k] = cols // (k * self.rank)
        return self._columns[k]

    def begin(self, ids: torch.Tensor | None) -> None:
        self.ids = ids
        self._masks.clear()

    def mask(self, k: int) -> torch.Tensor | None:
        """[num_tokens, L * k * R]: 1 where a column is the token's adapter's, else 0."""
        if self.ids is None:
            return None
        mask = self._masks.get(k)
        if mask is None:
            mask = (self.columns(k)[None, :] == self.ids[:, None]).to(self.dtype)
            self._masks[k] = mask
        return mask


class LoRALayer(nn.Module):
    """The stacked adapters of one projection (buffers: not the model's parameters)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, k: int, state: LoRAState) -> None:
        super().__init__()
        self.k, self.state = k, state
        self.register_buffer("a", a)  # [L * k * R, in]: every A, as a weight
        self.register_buffer("b", b)  # [L * k * R, out]

    def fill(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Replace an adapter slot's rows, in place (a captured graph reads these
        buffers): a [k * R, in] and b [k * R, out], or None for zeros."""
        size = self.k * self.state.rank
        rows = slice(slot * size, (slot + 1) * size)
        for stack, block in ((self.a, a), (self.b, b)):
            if block is None:
                stack[rows].zero_()
            else:
                stack[rows].copy_(block)

    def delta(self, x: torch.Tensor) -> LoRADelta | None:
        """The step's deltas for x [num_tokens, in] (None: no adapter ids this forward)."""
        ids = self.state.ids
        if ids is None:
            return None
        group = self.k * self.state.rank
        if splitk_pays(x, self.a):  # each token's other adapters' columns zeroed there
            workspace = self.state.shrink_workspace(*self.a.shape)
            shrink = splitk_linear(x, self.a, None, workspace, keep=RowGroups(ids, group))
            return LoRADelta(shrink, self.b, ids, group, masked=True)
        return LoRADelta(dense(x, self.a, None), self.b, ids, group)

    def add(self, delta: LoRADelta, y: torch.Tensor) -> torch.Tensor:
        """y += the deltas, in torch (products the split-K kernel does not take)."""
        shrink = delta.shrink if delta.masked else delta.shrink.mul_(self.state.mask(self.k))
        return y.addmm_(shrink, self.b)

    def forward(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x @ weight^T + bias with the deltas: at decode batch sizes the split-K
        kernel adds them in its epilogue, one launch (the shrink's) more than the
        projection alone."""
        delta = self.delta(x)
        if delta is None:
            return dense(x, weight, bias)
        if splitk_pays(x, weight):
            workspace = splitk_workspace(weight.shape[0], x.device)
            return splitk_linear(x, weight, bias, workspace, lora=delta)
        return self.add(delta, dense(x, weight, bias))


@dataclass(frozen=True)
class Target:
    """Where a PEFT module's delta lands: our projection, and which of its sections
    (None: all of it, e.g. Phi-3's fused qkv_proj targeted whole)."""

    path: str
    section: int | None


@dataclass(frozen=True)
class Projection:
    """What placing an adapter's A and B needs of a projection: how the ranks split it.
    Taken before any FP8 swap, which keeps none of it."""

    in_features: int  # this rank's
    out_features: int
    sections: tuple[Section, ...] | None  # column-parallel: this rank's rows of each
    in_start: int = 0  # row-parallel: this rank's first input column, of
    full_in_features: int = 0

    @classmethod
    def of(cls, linear: nn.Module) -> Projection:
        if isinstance(linear, ColumnParallelLinear):
            return cls(linear.in_features, linear.out_features, linear.sections)
        return cls(
            linear.in_features, linear.out_features, None, linear.in_start, linear.full_in_features
        )

    @property
    def k(self) -> int:
        """How many separately adapted sections its stack holds (q, k, v of a fused
        qkv_proj; gate and up of gate_up_proj). An adapter targeting the fused tensor
        whole (Phi-3's qkv_proj) uses its first section's columns for all of it."""
        return 1 if self.sections is None else len(self.sections)


def projections(model: nn.Module) -> dict[str, Projection]:
    """Every projection an adapter may target: the model's own linears, by path."""
    if getattr(model, "LORA_FUSED", None) is None:
        raise LoRAError(f"LoRA adapters are not supported for {model.config.model_type} models")
    kinds = (ColumnParallelLinear, RowParallelLinear)
    return {
        name: Projection.of(module)
        for name, module in model.named_modules()
        if isinstance(module, kinds)
    }


def resolve(model: nn.Module, module: str, adaptable: dict[str, Projection]) -> Target:
    """A PEFT module name (`model.layers.0.self_attn.q_proj`) as our projection."""
    parent, _, proj = module.removeprefix("model.").rpartition(".")
    fused, section = model.LORA_FUSED.get(proj, (proj, None))
    path = f"{parent}.{fused}" if parent else fused
    if path not in adaptable:
        raise LoRAError(
            f"LoRA on {module!r} is not supported (attention and dense MLP projections are)"
        )
    if fused == "qkv_proj" and section != 2:  # q or k rows, or all of qkv (Phi-3's)
        rotary = getattr(model.get_submodule(parent), "rotary", None)
        if getattr(rotary, "dim_order", None) is not None:
            raise LoRAError(f"LoRA on {module!r}: q/k rows are reordered for partial rotary")
    return Target(path, section)


def b_rows(proj: Projection, b: torch.Tensor, section: int | None) -> tuple[int, torch.Tensor]:
    """(first local output row, this rank's rows of B) for a target's section."""
    rank = b.shape[1]
    if proj.sections is None:
        return 0, read(TensorSlice(b), [proj.out_features, rank])
    if section is None:  # the fused tensor whole: each section's rows of this rank
        offset, ranges = 0, []
        for s in proj.sections:
            ranges += [(offset + lo, offset + hi) for lo, hi in s.ranges]
            offset += s.size
        return 0, read(TensorSlice(b), [offset, rank], tuple(ranges))
    s = proj.sections[section]
    start = sum(x.local_size for x in proj.sections[:section])
    return start, read(TensorSlice(b), [s.size, rank], s.ranges)


def a_cols(proj: Projection, a: torch.Tensor) -> torch.Tensor:
    """This rank's columns of A (a row-parallel projection's input is split)."""
    if proj.sections is not None:
        return read(TensorSlice(a), [a.shape[0], proj.in_features])
    cols = ((proj.in_start, proj.in_start + proj.in_features),)
    return read(TensorSlice(a), [a.shape[0], proj.full_in_features], cols, dim=1)
