"""LoRA adapter slots: which adapter each index of the stacked A and B holds. Filled at
startup from --lora-modules and, with --enable-lora, loaded and unloaded while serving
(vLLM's /v1/load_lora_adapter).

The stacks (engine/models/lora.py) have a fixed number of slots, so the CUDA graphs
captured over them stay valid: a load writes the adapter's A and B over a free slot's
rows in place, between steps, on the stream the steps run on. A slot is free when no
name maps to it and no live request still generates with it (an unloaded adapter's
requests run to their end). Each load takes a serial of its own, the root its requests'
KV blocks chain from, so a slot's next adapter never finds the last one's prefixes.

Without --enable-lora only the projections the startup adapters touch get stacks (no
shrink launched where none is needed); with it every projection an adapter may target
gets them, with --max-loras slots (at least one per startup adapter) at --max-lora-rank
(default: vLLM's 16, or the largest startup adapter's rank if that is more).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch import nn

from engine.checks import UnknownAdapter
from engine.models.lora import (
    AdapterWeights,
    LoRAError,
    LoRALayer,
    LoRAState,
    Projection,
    Target,
    a_cols,
    b_rows,
    projections,
    read_adapter,
    resolve,
)

logger = logging.getLogger("pagoda.engine")

RUNTIME_RANK = 16  # --max-lora-rank's default with --enable-lora (vLLM's)


@dataclass(frozen=True)
class LoRASettings:
    """EngineConfig's LoRA fields (EngineConfig.lora)."""

    adapters: dict[str, str]  # name -> PEFT directory, loaded at startup
    max_rank: int | None
    max_loras: int | None
    runtime: bool  # --enable-lora


@dataclass(frozen=True)
class ServedAdapter:
    name: str
    path: str


class LoRASlots:
    def __init__(
        self,
        model: nn.Module,
        state: LoRAState,
        layers: dict[str, LoRALayer],  # by projection path
        projections: dict[str, Projection],  # the same projections' splits
        runtime: bool,
    ) -> None:
        self.model, self.state, self.layers, self.projections = model, state, layers, projections
        self.runtime = runtime  # adapters may load while serving (--enable-lora)
        self.names: list[str | None] = [None] * state.slots
        self.serials = [0] * state.slots  # the load that filled each slot
        self._loads = 0
        self.served: tuple[ServedAdapter, ...] = ()  # the loaded adapters, in load order

    @classmethod
    @torch.no_grad()
    def attach(cls, model: nn.Module, settings: LoRASettings) -> LoRASlots:
        """Give the projections their stacks and load the startup adapters."""
        adapters, max_rank, runtime = settings.adapters, settings.max_rank, settings.runtime
        weights = [read_adapter(name, path) for name, path in adapters.items()]
        largest = max((w.rank for w in weights), default=0)
        rank = max(largest, RUNTIME_RANK if runtime else 1) if max_rank is None else max_rank
        adaptable = projections(model)
        if not runtime:  # the projections the adapters touch
            touched = {resolve(model, m, adaptable).path for w in weights for m in w.modules}
            adaptable = {path: p for path, p in adaptable.items() if path in touched}
        param = next(model.parameters())
        count = max(len(weights), settings.max_loras or 1) if runtime else len(weights)
        state = LoRAState(count, rank, param.dtype, param.device)
        layers = {}
        for path, proj in adaptable.items():
            a, b = (
                torch.zeros(
                    state.slots * proj.k * rank, size, dtype=param.dtype, device=param.device
                )
                for size in (proj.in_features, proj.out_features)
            )
            model.get_submodule(path).lora = layers[path] = LoRALayer(a, b, proj.k, state)
            state.columns(proj.k)  # built now, not inside a graph's capture
        slots = cls(model, state, layers, adaptable, runtime)
        for slot, ((name, path), w) in enumerate(zip(adapters.items(), weights, strict=True)):
            slots.write(slot, w)
            slots._take(slot, name, path)
        logger.info(
            "LoRA: %d adapter slots at rank %d on %d projections%s", state.slots, rank,
            len(layers), f", holding {', '.join(adapters)}" if adapters else "",
        )  # fmt: skip
        return slots

    def index(self, name: str | None) -> int:
        """The adapter's slot (-1: None, the base model)."""
        if name is None:
            return -1
        if name not in self.names:
            loaded = [a.name for a in self.served]
            raise UnknownAdapter(f"unknown LoRA adapter {name!r} (loaded: {loaded or 'none'})")
        return self.names.index(name)

    def load(self, name: str, path: str, busy: Collection[int], replace: bool = False) -> int:
        """Read an adapter into a free slot (busy: slots live requests still use); its slot.
        replace (vLLM's load_inplace): a loaded `name` gets the new weights; its own slot
        is free for them unless requests still run on the old ones, which then finish
        there, unnamed."""
        if not self.runtime:
            raise LoRAError("LoRA adapters load while serving only with --enable-lora")
        old = self.names.index(name) if name in self.names else None
        if old is not None and not replace:
            raise LoRAError(f"The lora adapter {name!r} has already been loaded.")
        free = [i for i, n in enumerate(self.names) if (n is None or i == old) and i not in busy]
        if not free:
            raise LoRAError(
                f"all {self.state.slots} LoRA adapter slots (--max-loras) hold adapters or "
                "their requests: unload one first"
            )
        slot = old if old in free else free[0]
        self.write(slot, read_adapter(name, path))  # a refusal leaves the old one served
        if old is not None:
            self.unload(name)
        self._take(slot, name, path)
        logger.info("loaded LoRA adapter %r from %s", name, path)
        return slot

    def unload(self, name: str) -> None:
        self.names[self.index(name)] = None
        self.served = tuple(a for a in self.served if a.name != name)
        logger.info("unloaded LoRA adapter %r", name)

    def _take(self, slot: int, name: str, path: str) -> None:
        self.names[slot] = name
        self.serials[slot], self._loads = self._loads, self._loads + 1
        self.served += (ServedAdapter(name, path),)

    @torch.no_grad()
    def write(self, slot: int, weights: AdapterWeights) -> None:
        """Put an adapter's A and B in a slot of every stack (zeros where it has none).
        Checked whole first: an adapter refused leaves the slot as it was."""
        name, rank = weights.name, self.state.rank
        if weights.rank > rank:
            raise LoRAError(
                f"LoRA adapter {name!r} has rank {weights.rank}, above --max-lora-rank {rank}"
            )
        targets: dict[str, list[tuple[Target, torch.Tensor, torch.Tensor]]] = {}
        for module, (a, b) in weights.modules.items():
            target = resolve(self.model, module, self.projections)
            targets.setdefault(target.path, []).append((target, a, b))
        blocks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for path, entries in targets.items():
            proj, layer = self.projections[path], self.layers[path]
            a_block = torch.zeros(layer.k * rank, proj.in_features)
            b_block = torch.zeros(layer.k * rank, proj.out_features)
            for target, a, b in entries:
                try:
                    cols = a_cols(proj, a)  # [r, in_local]
                    start, rows = b_rows(proj, b, target.section)  # [out rows, r]
                except ValueError as e:
                    raise LoRAError(f"LoRA adapter {name!r}, {path}: {e}") from e
                first = (target.section if layer.k > 1 and target.section is not None else 0) * rank
                a_block[first : first + cols.shape[0]] = cols
                b_block[first : first + rows.shape[1], start : start + rows.shape[0]] = rows.t()
            blocks[path] = (a_block, b_block)
        for path, layer in self.layers.items():
            a_block, b_block = blocks.get(path, (None, None))
            layer.fill(slot, a_block, b_block)
