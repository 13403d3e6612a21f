"""Embeddings (the server's /v1/embeddings) and classifier logits (/classify): a
pooling request's vector comes from its prompt's final hidden states (after the
model's last norm), pooled one of three ways, as vLLM's poolers do:

- LAST: the last token's, the pooling a decoder-only embedding model is trained with
  (Qwen3-Embedding, e5-mistral), and a decoder classifier's;
- CLS: the first token's, an encoder's default (bge) and its classifier's;
- MEAN: the mean over the prompt's tokens (e5, all-MiniLM).

A sentence-transformers directory names its pooling (modules.json's Pooling module);
else an encoder takes CLS, a decoder LAST. Its Dense modules after the pooling (LaBSE's
tanh layer, a projection to fewer dimensions) apply to the pooled vector, in fp32.
Embeddings are L2-normalized in fp32; a classifier's vector is its head's logits of the
pooled state, unnormalized.

The request is an ordinary one-token request: the step that runs its prompt's last
token samples its one token, and that step also pools the row. Such a step runs
eagerly (the graphs keep only logits); the token is dropped by the server. CLS and
MEAN read every prompt token's state, so such prompts run whole in one step, never
from the prefix cache (EngineConfig.whole_pooling_prompts).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.input_batch import InputBatch
from engine.models.bert import is_encoder
from engine.request import Request
from engine.scheduler import SchedulerOutput

logger = logging.getLogger("pagoda.engine")

POOLING_TYPES = ("LAST", "CLS", "MEAN")
# sentence-transformers' Pooling config key -> ours.
_ST_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
}


@dataclass
class PooledRows:
    """A step's embeddings: the pooling rows' slots, and their vectors [rows, dim] on
    the host, still being copied there when the step ran on CUDA: the step's sampled
    ids, copied after them, say when they are there (engine/step_reader.py)."""

    slots: list[int]
    vectors: torch.Tensor
    requests: list[Request] = field(default_factory=list)  # by slot, when launched


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host indices on the device without waiting for it: a copy from pageable memory
    would first wait for the stream (the step's forward) to drain."""
    tensor = torch.from_numpy(array)
    return tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor


def _st_modules(model_dir: str) -> list[dict]:
    """modules.json's entries, in order ([] without one)."""
    try:
        modules = json.loads((Path(model_dir) / "modules.json").read_text())
    except (OSError, ValueError):
        return []
    return [m for m in modules if isinstance(m, dict)] if isinstance(modules, list) else []


# sentence-transformers' Dense activation_function -> the module; others are refused.
_ACTIVATIONS = {
    "torch.nn.modules.linear.Identity": nn.Identity,
    "torch.nn.modules.activation.Tanh": nn.Tanh,
    "torch.nn.modules.activation.ReLU": nn.ReLU,
    "torch.nn.modules.activation.GELU": nn.GELU,
    "torch.nn.modules.activation.Sigmoid": nn.Sigmoid,
}
# Modules after the pooling that leave the vector as it is (Normalize: it is normalized).
_NO_CHANGE = ("Transformer", "Pooling", "Normalize")


def _dense(folder: Path) -> nn.Sequential:
    """One sentence-transformers Dense module: its linear layer and activation, fp32."""
    settings = json.loads((folder / "config.json").read_text())
    name = settings.get("activation_function", "torch.nn.modules.activation.Tanh")
    if name not in _ACTIVATIONS:
        raise ValueError(f"{folder}: Dense activation {name} is not supported")
    bias = settings.get("bias", True)
    linear = nn.Linear(settings["in_features"], settings["out_features"], bias=bias)
    if (folder / "model.safetensors").exists():
        from safetensors.torch import load_file

        state = load_file(folder / "model.safetensors")
    else:
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    linear.load_state_dict({k.removeprefix("linear."): v.float() for k, v in state.items()})
    return nn.Sequential(linear, _ACTIVATIONS[name]())


class Projector(nn.Sequential):
    """Dense modules in order: each a linear layer and its activation."""

    @property
    def out_features(self) -> int:  # the embeddings' length
        return [m for m in self if isinstance(m, nn.Linear)][-1].out_features


def projector(model_dir: str) -> Projector | None:
    """The sentence-transformers Dense modules an embedding passes through after its
    pooling, in order (None: none). A module that would change the vector otherwise is
    named in a warning: the embeddings then differ from sentence-transformers'."""
    layers: list[nn.Module] = []
    for module in _st_modules(model_dir):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Dense":
            layers.extend(_dense(Path(model_dir) / module.get("path", "")))
        elif kind not in _NO_CHANGE:
            logger.warning("%s: sentence-transformers module %s is not applied", model_dir, kind)
    return Projector(*layers).eval() if layers else None


def pooling_type(model_dir: str, hf_config) -> str:
    """How the model pools: a classifier as transformers scores a sequence (an encoder's
    first token, a decoder's last; ModernBERT's as its classifier_pooling says); an
    embedder as its sentence-transformers config says, else CLS for an encoder, LAST
    for a decoder."""
    default = "CLS" if is_encoder(hf_config) else "LAST"
    architectures = getattr(hf_config, "architectures", None) or []
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return getattr(hf_config, "classifier_pooling", default).upper()
    root = Path(model_dir)
    for module in _st_modules(model_dir):
        if str(module.get("type", "")).endswith("Pooling"):
            try:
                settings = json.loads((root / module.get("path", "") / "config.json").read_text())
            except (OSError, ValueError):
                break
            chosen = [ours for key, ours in _ST_MODES.items() if settings.get(key)]
            if len(chosen) == 1:
                return chosen[0]
            logger.warning(
                "%s: sentence-transformers pooling %s not supported (one of CLS, MEAN, "
                "last token); pooling %s",
                model_dir,
                {k: v for k, v in settings.items() if k.startswith("pooling_mode") and v},
                default,
            )
    return default


def pooling_rows(out: SchedulerOutput, batch: InputBatch) -> np.ndarray | None:
    """[S] bool over the step's sampling rows: those whose request pools (None: none)."""
    if not batch.num_pooling:
        return None
    rows = batch.pools[out.sampling_slots]
    return rows if rows.any() else None


def pool(
    hidden: torch.Tensor,
    last: torch.Tensor,
    rows: np.ndarray,
    out: SchedulerOutput,
    method: str,
    classifier: nn.Module | None = None,
    dense: nn.Module | None = None,  # an embedding's Dense modules (projector)
) -> PooledRows:
    """hidden: [num_tokens, hidden] the step's final hidden states; last: [num_sampling,
    hidden] the sampling rows' last tokens' (rows selects those that pool). For CLS
    and MEAN each pooling sequence's tokens in this step are its whole prompt."""
    picked = np.flatnonzero(rows)
    device = hidden.device
    if method == "LAST":
        states = last[_to(picked, device)]
    else:
        seqs = np.flatnonzero(out.samples)[picked]  # the pooling rows' sequences
        lengths = out.num_new_tokens[seqs]
        starts = (np.cumsum(out.num_new_tokens) - out.num_new_tokens)[seqs]
        if method == "CLS":
            states = hidden[_to(starts, device)]
        else:  # MEAN: the sum over each prompt's tokens, in fp32, over its length
            index = np.repeat(np.arange(len(seqs)), lengths)  # each token's pooling row
            before = np.cumsum(lengths) - lengths  # a row's first entry in `index`
            tokens = np.arange(len(index)) + np.repeat(starts - before, lengths)
            sums = hidden.new_zeros(len(seqs), hidden.shape[1], dtype=torch.float32)
            sums.index_add_(0, _to(index, device), hidden[_to(tokens, device)].float())
            states = sums / _to(lengths, device)[:, None]
    if classifier is not None:
        vectors = classifier(states)
    else:
        states = states.float() if dense is None else dense(states.float())
        vectors = torch.nn.functional.normalize(states, dim=-1)
    if device.type == "cuda":
        host = torch.empty(vectors.shape, dtype=vectors.dtype, pin_memory=True)
        vectors = host.copy_(vectors, non_blocking=True)
    return PooledRows(out.sampling_slots[rows].tolist(), vectors)
