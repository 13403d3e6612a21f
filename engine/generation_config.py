"""A model directory's generation_config.json: what its authors ask of generation.

What is read, as vLLM reads it: more stop ids than config.json's `eos_token_id`
(Llama 3 Instruct ends turns with <|eot_id|>, GPT-OSS tool calls with <|call|>), which
the engine always takes as EOS; and the sampling defaults the authors recommend (Qwen3:
temperature 0.6, top_p 0.95, top_k 20) and `max_new_tokens`, which the server applies
to requests that leave those fields out (`--generation-config auto`, the default).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger("pagoda.engine")

# The sampling fields taken from the file, as vLLM takes them.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class GenerationConfig:
    eos_token_ids: tuple[int, ...] = ()
    sampling: dict[str, float] = field(default_factory=dict)  # SAMPLING_FIELDS it sets
    max_new_tokens: int | None = None  # a chat answer's length when the request sets none


def load_generation_config(model_dir: str) -> GenerationConfig:
    """The directory's generation_config.json; empty when there is none (a file that
    cannot be read is logged and ignored: transformers would only warn too)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return GenerationConfig()
    try:
        raw = json.loads(path.read_text())
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        logger.warning("%s: ignored (%s)", path, e)
        return GenerationConfig()
    eos = raw.get("eos_token_id")
    eos_ids = tuple(i for i in (eos if isinstance(eos, list) else [eos]) if _is_int(i))
    sampling = {
        name: raw[name]
        for name in SAMPLING_FIELDS
        if isinstance(raw.get(name), int | float) and not isinstance(raw.get(name), bool)
    }
    max_new = raw.get("max_new_tokens")
    return GenerationConfig(
        eos_ids, sampling, max_new if _is_int(max_new) and max_new > 0 else None
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
