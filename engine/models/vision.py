"""A multimodal checkpoint's vision tower and projector: images to features.

transformers' modules, not ours: the tower runs once per image, outside the paged
cache and the CUDA graphs, so the reference implementation is the one to run. The
wrapper model (LlavaModel, Qwen2_5_VLModel, ...) is made without its language model,
whose weights are ours: only its tower and projector are built from the checkpoint's
config and filled with its tensors (under either naming, as engine/models/multimodal.py
reads the language model's), and its own methods give the features
(`get_image_features`) and, for the Qwen VL models, the prompt's 3-D rotary positions
(`get_rope_index`).

Families: LLaVA (CLIP or SigLIP towers; Pixtral 12B's checkpoint too), Mistral Small
3.1+ (Pixtral tower, patch merger), Gemma 3 (SigLIP, pooled; its image tokens attend to
their whole image: engine/images.py), Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE
(their image tokens take 3-D rotary positions, and Qwen3-VL's tower also gives features
added to the first layers' outputs: engine/images.py).

Features of images encoded lately are kept by the images' digest (`EncoderCache`), as
vLLM's encoder cache keeps them: a chat resends its images with every turn, and a beam
search with every beam's request, and neither runs the tower again.
"""

from __future__ import annotations

import importlib
import logging
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_MAPPING

from engine.images import (
    MROPE_FAMILIES,
    WHOLE_IMAGE_FAMILIES,
    ImageInputs,
    MRope,
    vision_family,
)
from engine.models.loader import RANDOM_WEIGHTS_MARKER, iter_weights

logger = logging.getLogger("pagoda.engine")

_PARTS = ("vision_tower.", "multi_modal_projector.", "visual.")


def vision_encoder(
    model_dir: str, device: torch.device, dtype: torch.dtype
) -> VisionEncoder | None:
    return VisionEncoder(model_dir, device, dtype) if vision_family(model_dir) else None


def _image_token_id(config: PretrainedConfig) -> int:
    token = getattr(config, "image_token_id", None)
    return token if token is not None else config.image_token_index


Encoded = tuple[torch.Tensor, list[torch.Tensor] | None]  # features, deepstack features

# Device memory the features of recent images may hold: a 448-px image is 256 rows of
# a 7B model's 3,584 values (1.8 MB in bf16), so ~140 images; within the headroom that
# --gpu-memory-utilization leaves.
ENCODER_CACHE_BYTES = 256 << 20


class EncoderCache:
    """The features of recently encoded images, by ImageInputs.digest, least recently
    used dropped first past `capacity` bytes."""

    def __init__(self, capacity: int = ENCODER_CACHE_BYTES) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[str, tuple[Encoded, int]] = OrderedDict()
        self.bytes = 0

    def get(self, digest: str) -> Encoded | None:
        entry = self.entries.get(digest)
        if entry is None:
            return None
        self.entries.move_to_end(digest)
        return entry[0]

    def put(self, digest: str, encoded: Encoded) -> None:
        if digest in self.entries:
            return
        features, deepstack = encoded
        size = sum(t.numel() * t.element_size() for t in [features, *(deepstack or [])])
        if size > self.capacity:
            return
        self.entries[digest] = (encoded, size)
        self.bytes += size
        while self.bytes > self.capacity:
            _, (_, dropped) = self.entries.popitem(last=False)
            self.bytes -= dropped


def _rows(per_image) -> torch.Tensor:
    """Per-image features as one [rows, hidden_size] tensor."""
    return torch.cat([f.reshape(-1, f.shape[-1]) for f in per_image])


def _towers(wrapper: type, config: PretrainedConfig) -> dict[str, nn.Module]:
    """The wrapper's vision modules, by the attribute names its methods use."""
    module = importlib.import_module(wrapper.__module__)
    if config.model_type in MROPE_FAMILIES:  # Qwen2VisionTransformerPretrainedModel, ...
        named = [n for n in dir(module) if n.endswith("VisionTransformerPretrainedModel")]
        if not named:  # Qwen3-VL's is an AutoModel
            return {"visual": AutoModel.from_config(config.vision_config)}
        return {"visual": getattr(module, named[0])._from_config(config.vision_config)}
    projector = getattr(module, wrapper.__name__.removesuffix("Model") + "MultiModalProjector")
    return {
        "vision_tower": AutoModel.from_config(config.vision_config),
        "multi_modal_projector": projector(config),
    }


class VisionEncoder:
    def __init__(self, model_dir: str, device: torch.device, dtype: torch.dtype) -> None:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        self.config = config
        self.image_token_id = _image_token_id(config)
        self.whole_images = config.model_type in WHOLE_IMAGE_FAMILIES
        self.mrope = config.model_type in MROPE_FAMILIES
        kind = MODEL_MAPPING[type(config)]  # e.g. LlavaModel: get_image_features' home
        # The wrapper without its __init__ (which would build the language model too).
        wrapper = kind.__new__(kind)
        nn.Module.__init__(wrapper)
        wrapper.config = config
        with torch.device(device):
            for name, tower in _towers(kind, config).items():
                setattr(wrapper, name, tower.to(dtype))
        if not (Path(model_dir) / RANDOM_WEIGHTS_MARKER).is_file():  # a benchmark's: as built
            state = {}
            for name, weight in iter_weights(model_dir):
                bare = name.removeprefix("model.")
                if bare.startswith(_PARTS):
                    state[bare] = weight[:]
            wrapper.load_state_dict(state, strict=True)  # a missing or unknown tensor: an error
        self.wrapper = wrapper.eval()
        self.device, self.dtype = device, dtype
        # encode()'s results computed ahead, several requests' images in one call (prefetch)
        self._ready: dict[int, Encoded] = {}
        self.cache = EncoderCache()
        logger.info(
            "vision encoder: %s (%.0fM parameters)",
            ", ".join(type(m).__name__ for m in wrapper.children()),
            sum(p.numel() for p in wrapper.parameters()) / 1e6,
        )

    def encode(self, images: ImageInputs) -> Encoded:
        """Every image's features in order, [num_placeholders, hidden_size]; and Qwen3-VL's
        deepstack features, one such tensor per layer they are added to (else None)."""
        ready = self._ready.pop(id(images), None) or self.cache.get(images.digest)
        if ready is None:
            features, deepstack = self._tower([images])
            ready = _rows(features), None if deepstack is None else [_rows(d) for d in deepstack]
        self.cache.put(images.digest, ready)
        return ready

    def prefetch(self, batch: list[ImageInputs]) -> None:
        """Encode several requests' images in one call of the tower per shape (a burst of
        adds costs one call, not one each); encode() then hands each request its own."""
        self.forget()
        try:
            self._prefetch(batch)
        except Exception:  # each request's own encode() will meet (and report) it
            logger.exception("encoding a burst's images together failed")
            self.forget()

    def forget(self) -> None:
        """Drop what prefetch encoded and no encode() took (a refused request's)."""
        self._ready.clear()

    def _prefetch(self, batch: list[ImageInputs]) -> None:
        groups: dict[tuple, list[ImageInputs]] = {}
        new = {images.digest: images for images in batch if self.cache.get(images.digest) is None}
        for images in new.values():  # each distinct image once; encode() finds the rest cached
            key = (tuple(images.pixel_values.shape[1:]), tuple(sorted(images.extra)))
            groups.setdefault(key, []).append(images)
        for group in groups.values():
            if len(group) < 2:
                continue
            features, deepstack = self._tower(group)
            start = 0
            for images in group:  # each request's images, in order
                n = images.num_images
                mine = slice(start, start + n)
                levels = None if deepstack is None else [_rows(d[mine]) for d in deepstack]
                self._ready[id(images)] = encoded = (_rows(features[mine]), levels)
                self.cache.put(images.digest, encoded)  # for the burst's others of it
                start += n

    @torch.inference_mode()
    def _tower(self, batch: list[ImageInputs]) -> tuple[list, list[list] | None]:
        """The batch's images, through the tower and projector: features per image, and
        deepstack features per layer per image (Qwen3-VL's; else None)."""
        pixels = torch.cat([images.pixel_values for images in batch])
        extra = {
            name: torch.cat([images.extra[name] for images in batch]).to(self.device)
            for name in batch[0].extra
        }
        out = self.wrapper.get_image_features(
            pixel_values=pixels.to(self.device, self.dtype), **extra
        )
        deepstack = getattr(out, "deepstack_features", None)
        return list(out.pooler_output), None if deepstack is None else [list(d) for d in deepstack]

    def rope_index(self, prompt_token_ids: list[int], images: ImageInputs) -> MRope:
        """The Qwen VL models' rotary positions of the prompt's tokens."""
        ids = torch.tensor([prompt_token_ids])
        kinds = (ids == self.image_token_id).int()
        positions, delta = self.wrapper.get_rope_index(
            ids, mm_token_type_ids=kinds, image_grid_thw=images.extra["image_grid_thw"]
        )
        return MRope(positions[:, 0].numpy().astype(np.int64), int(delta))
