"""Multimodal checkpoints' language models: LLaVA, Gemma 3 from 4B up, Gemma 4 (text
only), Mistral Small 3.1 and later, Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE.
(The Qwen models' multimodal rotary sections see one position per text token, which
is plain rotary; image tokens' 3-D positions are engine/images.py's.)
The language model's tensors sit under `language_model.` (`model.language_model.` in
newer saves); the vision tower's and the projector's are read by
engine/models/vision.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from transformers import PretrainedConfig

from engine.models.parallel import WeightSlice

# model_type -> the attribute holding the language model's config
TEXT_OF_MULTIMODAL = {
    kind: "text_config"
    for kind in (
        "exaone4_5",
        "gemma3",
        "gemma4",
        "llama4",
        "llava",
        "mistral3",
        "qwen2_vl",
        "qwen2_5_vl",
        "qwen3_vl",
        "qwen3_vl_moe",
        "qwen3_5",
        "qwen3_5_moe",
    )  # fmt: skip
}
_VISION_PARTS = ("vision_tower.", "multi_modal_projector.", "visual.", "vision_model.")
_VISION_PARTS += ("audio_tower.", "embed_vision.", "embed_audio.")  # Gemma 4's


def is_multimodal(model_dir: str) -> bool:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return config.get("model_type") in TEXT_OF_MULTIMODAL


def language_config(outer: PretrainedConfig, has_head: bool) -> PretrainedConfig:
    """The language model's config, with the checkpoint's dtype; has_head: whether the
    checkpoint holds an LM head. Raises ValueError for a quantized checkpoint."""
    if getattr(outer, "quantization_config", None):
        raise ValueError(
            f"a quantized multimodal {outer.model_type} checkpoint is not supported (its "
            "bf16 or fp16 one is, with --quantization fp8)"
        )
    config = getattr(outer, TEXT_OF_MULTIMODAL[outer.model_type])
    config.dtype = getattr(config, "dtype", None) or getattr(outer, "dtype", None)
    # The outer and the text config may disagree on tying (transformers follows the
    # outer one, whose default may say tied beside a head of its own): the checkpoint's
    # head where it has one (a tied one equals the embeddings), else the embeddings.
    config.tie_word_embeddings = not has_head
    return config


def language_model_weights(
    weights: Iterator[tuple[str, WeightSlice]],
) -> Iterator[tuple[str, WeightSlice]]:
    """The checkpoint's language model tensors, under a text model's names."""
    for name, weight in weights:
        bare = name.removeprefix("model.")
        if bare.startswith(_VISION_PARTS):
            continue
        if bare.startswith("language_model."):
            rest = bare.removeprefix("language_model.")
            # `language_model.model.layers...` (and its lm_head) or `model.language_model.layers...`
            name = rest if name.startswith("language_model.") else f"model.{rest}"
        yield name, weight
