"""Pagoda's engine: continuous batching over a paged KV cache.

The names below are loaded on first use: `import engine` (and the server's CLI,
which reads EngineConfig's defaults) must not pay for torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.llm import LLM, LoRARequest
    from engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "LoRARequest", "SamplingParams"]
_MODULES = {
    "LLM": "engine.llm",
    "LoRARequest": "engine.llm",
    "EngineConfig": "engine.config",
    "SamplingParams": "engine.sampling_params",
}


def __getattr__(name: str) -> object:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
