"""Images in prompts: what a request brings (its processor's pixel values), what the
engine keeps of it (the projected image features, one row per image token of the
prompt), and each step's share of them.

The prompt holds one placeholder id (the model's `image_token_id`) per feature row,
as the model's processor expands them. The engine encodes a request's images once,
when it is added, and keeps the features while the request lives (a preempted request
recomputes from them). A prefill chunk's tokens are embedded as usual, and the rows
of its placeholders are then overwritten with their features (`ImageRows`), as
transformers' models scatter them into `inputs_embeds`. A request's blocks hash from a
root salted with its images' digest: the same text with another image is another
prompt to the prefix cache.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the API processes import this module, and need torch for images only
    import torch

    from engine.input_batch import InputBatch
    from engine.models.vision import VisionEncoder
    from engine.scheduler import SchedulerOutput


# Families whose images are read (engine/models/vision.py): those whose language model
# sees an image as plain causal tokens, one position each.
VISION_FAMILIES = ("llava", "mistral3")


def reads_images(model_dir: str) -> bool:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return config.get("model_type") in VISION_FAMILIES


@dataclass
class ImageInputs:
    """A prompt's images as its model's processor made them."""

    pixel_values: torch.Tensor  # [num_images, channels, height, width] (padded to the largest)
    image_sizes: torch.Tensor | None = None  # [num_images, 2]: each one's (height, width)
    digest: str = ""  # of the images' pixels: salts the prefix cache (filled if empty)

    def __post_init__(self) -> None:
        if not self.digest:
            h = hashlib.sha256(np.ascontiguousarray(self.pixel_values.float().numpy()).tobytes())
            if self.image_sizes is not None:
                h.update(self.image_sizes.numpy().tobytes())
            self.digest = h.hexdigest()


@dataclass
class PromptImages:
    """What the engine keeps of a request's images (shared by its n choices)."""

    features: torch.Tensor  # [num_placeholders, hidden_size] on the device, model dtype
    positions: np.ndarray  # [num_placeholders] int64: their prompt positions, ascending


@dataclass
class ImageRows:
    """A step's image features and the rows of the step's tokens they replace."""

    rows: torch.Tensor  # [n] int64, on the device
    features: torch.Tensor  # [n, hidden_size]

    def apply(self, embeds: torch.Tensor) -> torch.Tensor:
        """The step's token embeddings [num_tokens, hidden] with the image rows in place."""
        return embeds.index_put((self.rows,), self.features.to(embeds.dtype))


def placeholder_positions(prompt_token_ids: list[int], image_token_id: int) -> np.ndarray:
    return np.flatnonzero(np.asarray(prompt_token_ids) == image_token_id).astype(np.int64)


def plan_images(out: SchedulerOutput, batch: InputBatch) -> ImageRows | None:
    """The image rows of the step's tokens, or None when no scheduled token is one."""
    if not batch.num_images:
        return None
    has = batch.has_images[out.slots]
    if not has.any():
        return None
    query_starts = np.cumsum(out.num_new_tokens) - out.num_new_tokens
    rows, features = [], []
    for b in np.flatnonzero(has).tolist():
        images = batch.requests[int(out.slots[b])].images
        start = int(out.starts[b])
        lo, hi = np.searchsorted(images.positions, [start, start + int(out.num_new_tokens[b])])
        if lo == hi:
            continue
        rows.append(images.positions[lo:hi] - start + query_starts[b])
        features.append(images.features[lo:hi])
    if not rows:
        return None
    import torch

    device = features[0].device
    return ImageRows(torch.from_numpy(np.concatenate(rows)).to(device), torch.cat(features))


def encode_prompt_images(
    encoder: VisionEncoder | None, prompt_token_ids: list[int], images: ImageInputs
) -> PromptImages:
    """The request's image features, checked against its placeholders (ValueError)."""
    if encoder is None:
        raise ValueError("this model takes no images")
    positions = placeholder_positions(prompt_token_ids, encoder.image_token_id)
    features = encoder.encode(images)
    if len(features) != len(positions):
        raise ValueError(
            f"the prompt holds {len(positions)} image placeholder tokens, but its "
            f"{len(images.pixel_values)} images give {len(features)} features"
        )
    return PromptImages(features, positions)
