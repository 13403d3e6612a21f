"""The engine's stats, a snapshot taken after every step: the server's /metrics, its
periodic stats line and the served adapters' list read it, in this process or, pickled,
in the API processes."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from engine.models.lora_slots import LoRASlots, ServedAdapter
from engine.request import Request


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks in use
    num_preemptions: int  # cumulative
    prefix_cache_queries: int  # cumulative tokens looked up
    prefix_cache_hits: int  # cumulative tokens found
    spec_decode_num_draft_tokens: int = 0  # cumulative (engine/speculative.py)
    spec_decode_num_accepted_tokens: int = 0
    lora_adapters: tuple[ServedAdapter, ...] = ()  # served now, in load order
    # LoRA serving only: the adapters running and waiting requests ask for (loaded ones,
    # by name, sorted) and how many slots there are (vLLM's lora_requests_info).
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
    max_loras: int = 0


def lora_stats(
    slots: LoRASlots, running: np.ndarray, waiting: Iterable[Request]
) -> dict[str, object]:
    """EngineStats' LoRA fields: the served adapters, and those running requests (their
    InputBatch column of adapter indices) and waiting ones use, by name (an unloaded
    adapter's requests finish on it, unnamed)."""
    names = slots.names

    def named(indices: Iterable[int]) -> tuple[str, ...]:
        return tuple(sorted({names[i] for i in indices if i >= 0} - {None}))

    return dict(
        lora_adapters=slots.served,
        lora_running=named(np.unique(running).tolist()),
        lora_waiting=named({r.lora_index for r in waiting}),
        max_loras=len(names),
    )
