"""Pagoda's engine: continuous batching over a paged KV cache."""

from engine.config import EngineConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "SamplingParams"]
