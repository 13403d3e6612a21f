"""A multimodal checkpoint's vision tower and projector: images to features.

transformers' modules, not ours: the tower runs once per image, outside the paged
cache and the CUDA graphs, so the reference implementation is the one to run. They
are built from the checkpoint's config and filled with its tensors (under either
naming, as engine/models/multimodal.py reads the language model's), and the features
come from the wrapper model's own `get_image_features`, called on a module that holds
the tower and projector only (not the language model, whose weights are ours).

Families whose language model gives image tokens one position each: LLaVA (CLIP or
SigLIP towers; Pixtral 12B's checkpoint too), Mistral Small 3.1+ (Pixtral tower, patch
merger) and Gemma 3 (SigLIP, pooled; its image tokens attend to their whole image:
engine/images.py). The Qwen VL models give image tokens 3-D rotary positions: their
images are refused.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_MAPPING

from engine.images import WHOLE_IMAGE_FAMILIES, ImageInputs, reads_images
from engine.models.loader import RANDOM_WEIGHTS_MARKER, iter_weights

logger = logging.getLogger("pagoda.engine")

_PARTS = ("vision_tower.", "multi_modal_projector.")


def vision_encoder(
    model_dir: str, device: torch.device, dtype: torch.dtype
) -> VisionEncoder | None:
    return VisionEncoder(model_dir, device, dtype) if reads_images(model_dir) else None


def _image_token_id(config: PretrainedConfig) -> int:
    token = getattr(config, "image_token_id", None)
    return token if token is not None else config.image_token_index


class VisionEncoder(nn.Module):
    def __init__(self, model_dir: str, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        self.config = config
        self.image_token_id = _image_token_id(config)
        self.whole_images = config.model_type in WHOLE_IMAGE_FAMILIES
        wrapper = MODEL_MAPPING[type(config)]  # e.g. LlavaModel: get_image_features' home
        self._features = wrapper.get_image_features
        projector = _projector_class(wrapper)
        with torch.device(device):
            self.vision_tower = AutoModel.from_config(config.vision_config, dtype=dtype)
            self.multi_modal_projector = projector(config).to(dtype)
        if not (Path(model_dir) / RANDOM_WEIGHTS_MARKER).is_file():  # a benchmark's: as built
            state = {}
            for name, weight in iter_weights(model_dir):
                bare = name.removeprefix("model.")
                if bare.startswith(_PARTS):
                    state[bare] = weight[:]
            self.load_state_dict(state, strict=True)  # a missing or unknown tensor: an error
        self.eval()
        self.device, self.dtype = device, dtype
        logger.info(
            "vision encoder: %s (%.0fM parameters)",
            type(self.vision_tower).__name__,
            sum(p.numel() for p in self.parameters()) / 1e6,
        )

    @torch.inference_mode()
    def encode(self, images: ImageInputs) -> torch.Tensor:
        """[num_placeholders, hidden_size]: every image's features, in order."""
        kwargs = {}
        if images.image_sizes is not None:
            kwargs["image_sizes"] = images.image_sizes.to(self.device)
        pixels = images.pixel_values.to(self.device, self.dtype)
        out = self._features(self, pixel_values=pixels, **kwargs).pooler_output
        return torch.cat([f.reshape(-1, f.shape[-1]) for f in out])


def _projector_class(wrapper: type) -> type:
    """The wrapper's projector class (LlavaMultiModalProjector, ...), from its module."""
    import importlib

    module = importlib.import_module(wrapper.__module__)
    name = wrapper.__name__.removesuffix("Model") + "MultiModalProjector"
    return getattr(module, name)
