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

The Qwen VL models give each image token a 3-D rotary position (temporal, height,
width: transformers' `get_rope_index`), text a 1-D one that goes on from the largest
before it, so past an image a token's position is its index plus an offset (`MRope`).
The staged positions carry each token's first component (the only one, for text);
a step with image tokens runs eagerly, its rotary cos/sin built per token from all
three (`ImageRows.positions3`). Qwen3-VL's tower also gives features for several of
the first layers ("deepstack"), added to those layers' outputs at the image tokens.

Gemma 3's image tokens attend to their whole image both ways (a run of consecutive
placeholders), the rest causally. A placeholder's attention horizon is then its run's
last position (the prefill kernel's `horizons`), and no chunk ends inside a run: it
stops before a run it cannot hold whole. So every computed image token saw its whole
image, and a prefix-cache hit may end anywhere (the rest of its run comes next, whole).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the API processes import this module, and need torch for images only
    import torch

    from engine.input_batch import InputBatch
    from engine.models.rope import RotaryEmbedding
    from engine.models.vision import VisionEncoder
    from engine.scheduler import SchedulerOutput


# Families whose images are read (engine/models/vision.py), and those of them whose
# image tokens take 3-D positions or see their whole image.
MROPE_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")  # 3-D positions
VISION_FAMILIES = ("gemma3", "llava", "mistral3", *MROPE_FAMILIES)
WHOLE_IMAGE_FAMILIES = ("gemma3",)  # an image's tokens see each other both ways


def vision_family(model_dir: str) -> str | None:
    """The checkpoint's model_type, if it is of a family whose images are read."""
    kind = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    return kind if kind in VISION_FAMILIES else None


@dataclass
class ImageInputs:
    """A prompt's images as its model's processor made them."""

    # [num_images, channels, height, width] (padded to the largest), or the Qwen VL
    # models' patches [num_patches, channels * temporal * patch * patch]
    pixel_values: torch.Tensor
    # The processor's other image outputs, by name, for get_image_features: image_sizes
    # ([num_images, 2], Pixtral's), image_grid_thw ([num_images, 3], Qwen VL's).
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    digest: str = ""  # of the images' pixels: salts the prefix cache (filled if empty)

    @property
    def num_images(self) -> int:
        grid = self.extra.get("image_grid_thw")  # the Qwen VL models' patches are rows of one
        return len(grid) if grid is not None else len(self.pixel_values)

    def __post_init__(self) -> None:
        if not self.digest:
            h = hashlib.sha256(np.ascontiguousarray(self.pixel_values.float().numpy()).tobytes())
            for name in sorted(self.extra):
                h.update(self.extra[name].numpy().tobytes())
            self.digest = h.hexdigest()


@dataclass
class MRope:
    """The Qwen VL models' rotary positions of a prompt with images."""

    positions: np.ndarray  # [3, prompt_len] int64: temporal, height, width
    delta: int  # a token past the prompt is at its index + delta (in all three)

    def first(self, index: np.ndarray) -> np.ndarray:
        """The first component of the positions of the tokens at index."""
        n = self.positions.shape[1]
        inside = self.positions[0][np.minimum(index, n - 1)]
        return np.where(index < n, inside, index + self.delta)


@dataclass
class PromptImages:
    """What the engine keeps of a request's images (shared by its n choices)."""

    features: torch.Tensor  # [num_placeholders, hidden_size] on the device, model dtype
    positions: np.ndarray  # [num_placeholders] int64: their prompt positions, ascending
    # Both ways within an image: each placeholder's run's last position, and the runs.
    ends: np.ndarray | None = None  # [num_placeholders] int64
    run_starts: np.ndarray | None = None  # [num_runs] int64, ascending
    run_ends: np.ndarray | None = None  # [num_runs] int64, inclusive
    mrope: MRope | None = None  # the Qwen VL models'
    # Qwen3-VL's: per layer from the first, [num_placeholders, hidden_size] to add to its output
    deepstack: list[torch.Tensor] | None = None

    @classmethod
    def of(cls, features: torch.Tensor, positions: np.ndarray, whole: bool) -> PromptImages:
        if not whole or len(positions) == 0:
            return cls(features, positions)
        breaks = np.flatnonzero(np.diff(positions) != 1)  # the last index of each run but one
        run_starts = positions[np.concatenate(([0], breaks + 1))]
        run_ends = positions[np.concatenate((breaks, [len(positions) - 1]))]
        ends = run_ends[np.searchsorted(run_starts, positions, side="right") - 1]
        return cls(features, positions, ends, run_starts, run_ends)

    @property
    def longest_run(self) -> int:
        return 0 if self.run_starts is None else int((self.run_ends - self.run_starts).max()) + 1

    def chunk_end(self, start: int, end: int) -> int:
        """Where a chunk of positions [start, end) may end so as not to split a run: end,
        or the start of the run it would end in (start: it waits for room for the run)."""
        if self.run_starts is None:
            return end
        i = int(np.searchsorted(self.run_starts, end, side="left")) - 1  # last run before end
        if i < 0 or end > self.run_ends[i]:  # ends outside every run (or at one's end)
            return end
        return max(int(self.run_starts[i]), start)


@dataclass
class ImageRows:
    """A step's image features and the rows of the step's tokens they replace."""

    rows: torch.Tensor  # [n] int64, on the device
    features: torch.Tensor  # [n, hidden_size]
    ends: torch.Tensor | None = None  # [n] int32: each row's horizon (WHOLE_IMAGE_FAMILIES)
    positions3: torch.Tensor | None = None  # [3, n] int64: each row's rotary (MROPE_FAMILIES)
    deepstack: list[torch.Tensor] | None = None  # [n, hidden_size] per layer (Qwen3-VL's)

    def apply(self, embeds: torch.Tensor) -> torch.Tensor:
        """The step's token embeddings [num_tokens, hidden] with the image rows in place."""
        return embeds.index_put((self.rows,), self.features.to(embeds.dtype))

    def rope_table(self, rotary: RotaryEmbedding, positions: torch.Tensor) -> torch.Tensor:
        """[num_tokens, head_dim]: each of the step's tokens' rotary cos/sin, the image
        rows' from their 3-D positions (a frequency of each mrope_section part from its
        part's position), the rest's from positions, as transformers' multimodal rotary
        takes them."""
        import torch

        pos3 = positions.expand(3, -1).clone()
        pos3[:, self.rows] = self.positions3.to(pos3.dtype)
        sizes = rotary.mrope_section
        section = torch.repeat_interleave(torch.arange(3), torch.tensor(sizes))
        if rotary.mrope_interleaved:  # frequency j: height's if j % 3 == 1, width's if 2,
            j = torch.arange(len(section))  # up to 3 x their section sizes; the rest temporal
            section = torch.zeros_like(j)
            section[(j % 3 == 1) & (j < 3 * sizes[1])] = 1
            section[(j % 3 == 2) & (j < 3 * sizes[2])] = 2
        section = section.to(pos3.device)
        rest = section.new_zeros((rotary.head_dim - rotary.rotary_dim) // 2)  # cos 1, sin 0
        part = torch.cat([section, rest, section, rest])  # the cos half, then the sin half
        table = rotary.cos_sin[pos3]  # [3, num_tokens, head_dim]
        return table.gather(0, part.expand(1, pos3.shape[1], -1)).squeeze(0)

    def horizons(self, positions: torch.Tensor) -> torch.Tensor | None:
        """[num_tokens] int32: the last position each of the step's tokens attends to
        (its own, or its image's last), for the prefill kernel; None: causal as usual."""
        if self.ends is None:
            return None
        return positions.int().index_put((self.rows,), self.ends)


def placeholder_positions(prompt_token_ids: list[int], image_token_id: int) -> np.ndarray:
    return np.flatnonzero(np.asarray(prompt_token_ids) == image_token_id).astype(np.int64)


def plan_images(out: SchedulerOutput, batch: InputBatch) -> ImageRows | None:
    """The image rows of the step's tokens, or None when no scheduled token is one."""
    if not batch.num_images:
        return None
    has = out.starts < batch.images_end[out.slots]
    if not has.any():
        return None
    query_starts = np.cumsum(out.num_new_tokens) - out.num_new_tokens
    rows, features, ends, positions3, deepstack = [], [], [], [], []
    for b in np.flatnonzero(has).tolist():
        images = batch.requests[int(out.slots[b])].images
        start = int(out.starts[b])
        lo, hi = np.searchsorted(images.positions, [start, start + int(out.num_new_tokens[b])])
        if lo == hi:
            continue
        rows.append(images.positions[lo:hi] - start + query_starts[b])
        features.append(images.features[lo:hi])
        if images.ends is not None:
            ends.append(images.ends[lo:hi])
        if images.mrope is not None:
            positions3.append(images.mrope.positions[:, images.positions[lo:hi]])
        if images.deepstack is not None:
            deepstack.append([level[lo:hi] for level in images.deepstack])
    if not rows:
        return None
    import torch

    device = features[0].device
    horizons = None
    if ends:  # a model's images are all of one kind: every row has one, or none does
        horizons = torch.from_numpy(np.concatenate(ends).astype(np.int32)).to(device)
    rope = None
    if positions3:
        # C order: a broadcast to the other ranks sends the tensor's memory as it lies.
        rope = torch.from_numpy(np.ascontiguousarray(np.concatenate(positions3, axis=1)))
        rope = rope.to(device)
    levels = [torch.cat(level) for level in zip(*deepstack)] if deepstack else None
    return ImageRows(
        torch.from_numpy(np.concatenate(rows)).to(device),
        torch.cat(features),
        horizons,
        rope,
        levels,
    )


def apply_mrope(batch: InputBatch, token_slots: np.ndarray, positions: np.ndarray) -> None:
    """The staged positions of the Qwen VL requests' tokens: their rotary positions'
    first component (positions holds token indices on entry)."""
    rows = np.flatnonzero(batch.has_mrope[token_slots])
    for slot in np.unique(token_slots[rows]).tolist():
        mine = rows[token_slots[rows] == slot]
        positions[mine] = batch.requests[slot].images.mrope.first(positions[mine])


def keep_images_whole(
    batch: InputBatch, slots: np.ndarray, computed: np.ndarray, num_new: np.ndarray
) -> None:
    """Cut in place the chunks (num_new) of the rows whose images must not be split
    (a row may be left with none this step: it waits for room for its image)."""
    for i in np.flatnonzero(batch.whole_images[slots]).tolist():
        images = batch.requests[int(slots[i])].images
        start = int(computed[i])
        num_new[i] = images.chunk_end(start, start + int(num_new[i])) - start


def encode_prompt_images(
    encoder: VisionEncoder | None,
    prompt_token_ids: list[int],
    images: ImageInputs,
    max_step_tokens: int,
) -> PromptImages:
    """The request's image features, checked against its placeholders (ValueError)."""
    if encoder is None:
        raise ValueError("this model takes no images")
    positions = placeholder_positions(prompt_token_ids, encoder.image_token_id)
    features, deepstack = encoder.encode(images)
    if len(features) != len(positions):
        raise ValueError(
            f"the prompt holds {len(positions)} image placeholder tokens, but its "
            f"{images.num_images} images give {len(features)} features"
        )
    prompt_images = PromptImages.of(features, positions, encoder.whole_images)
    if encoder.mrope:
        prompt_images.mrope = encoder.rope_index(prompt_token_ids, images)
    prompt_images.deepstack = deepstack
    if prompt_images.longest_run > max_step_tokens:
        raise ValueError(
            f"an image of {prompt_images.longest_run} tokens does not fit one step "
            f"(--max-num-batched-tokens {max_step_tokens})"
        )
    return prompt_images
