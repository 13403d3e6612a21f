"""Build a model from a local Hugging Face directory: config, safetensors, tokenizer."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from engine.config import EngineConfig
from engine.distributed import SINGLE, TensorParallel
from engine.models.bert import ENCODER_TYPES, ClassifierHead, encoder_max_len
from engine.models.lora import LoRAError
from engine.models.lora_slots import LoRASettings, LoRASlots
from engine.models.multimodal import (
    TEXT_OF_MULTIMODAL,
    is_multimodal,
    language_config,
    language_model_weights,
)
from engine.models.parallel import WeightSlice
from engine.models.quantization import (
    checkpoint_fp8,
    dequantize_checkpoint,
    quantize_linears_at_load,
    quantize_model,
    set_kv_scales,
)
from engine.models.registry import MODEL_TYPES
from engine.models.rope import RotaryEmbedding, rope_positions, rope_settings
from engine.models.weight_copy import fill_quantized, staged_copies
from kernels.fp8 import FP8_DTYPE, check_fp8_device, fp8_supported

logger = logging.getLogger("pagoda.engine")

# A benchmark checkpoint too large to write out (benchmarks/checkpoints.py): config and
# tokenizer only; the weights are drawn on the device at load, like vLLM's dummy format.
RANDOM_WEIGHTS_MARKER = "pagoda-random-weights"


class ModelLoadError(ValueError):
    """A model directory that cannot be served; the message names the file and the problem."""


def load_config(model_dir: str) -> PretrainedConfig:
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelLoadError(f"model directory {model_dir!r} does not exist")
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"{path / 'config.json'}: missing (not a Hugging Face model directory?)"
        )
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises several kinds here
        raise ModelLoadError(f"{path / 'config.json'}: cannot be read: {e}") from e
    if config.model_type in TEXT_OF_MULTIMODAL:
        if (path / RANDOM_WEIGHTS_MARKER).is_file():  # a benchmark's: a head unless tied
            has_head = not getattr(config, "tie_word_embeddings", False)
        else:
            has_head = any(n.endswith("lm_head.weight") for n, _ in iter_weights(str(path)))
        try:
            config = language_config(config, has_head)
        except ValueError as e:
            raise ModelLoadError(f"{path / 'config.json'}: {e}") from e
        logger.info("%s: a multimodal checkpoint: its language model, text only", path)
    if config.model_type not in MODEL_TYPES:
        raise ModelLoadError(
            f"{path / 'config.json'}: unsupported architecture {config.model_type!r} "
            f"({', '.join(getattr(config, 'architectures', None) or [])}); "
            f"supported model types: {', '.join(sorted(MODEL_TYPES))}"
        )
    try:
        checkpoint_fp8(config)  # a quantization scheme we cannot read fails here
        build_on_meta(config)  # the model checks its config, the rotary embeddings rope_scaling
    except ValueError as e:
        raise ModelLoadError(f"{path / 'config.json'}: {e}") from e
    return config


def build_on_meta(config: PretrainedConfig, tp: TensorParallel = SINGLE) -> nn.Module:
    """This rank's shard of the model on the meta device, its initialisers not run: every
    weight comes from the checkpoint, and `normal_` on a meta tensor would go through
    torch._refs, whose first use imports torch._dynamo (a second or more of startup)."""
    with torch.device("meta"), _initialisers_skipped():
        return MODEL_TYPES[config.model_type](config, tp)


@contextlib.contextmanager
def _initialisers_skipped() -> Iterator[None]:
    """torch.nn.init's in-place initialisers (nn.Linear's, nn.Embedding's, ...) made no-ops."""
    names = [n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {name: getattr(nn.init, name) for name in names}
    for name in saved:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def max_model_len(config: PretrainedConfig) -> int:
    """The longest context the model handles exactly (with YaRN, what it extends to)."""
    if config.model_type in ENCODER_TYPES:
        return encoder_max_len(config)
    positions = getattr(config, "n_positions", None) or config.max_position_embeddings
    return rope_positions(positions, rope_settings(config)[1])


def checkpoint_dtype(config: PretrainedConfig) -> torch.dtype | None:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def iter_weights(model_dir: str) -> Iterator[tuple[str, WeightSlice]]:
    """Each checkpoint tensor, unread: the model reads only its rank's slices of it (valid
    until the next one is yielded). The files are the index's shards, else every
    *.safetensors file."""
    path = Path(model_dir)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from e
        files = [path / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{index}: names shard {f.name}, which is missing")
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{path}: no *.safetensors weights found")
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as reader:
                for name in reader.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, reader.get_slice(name)
        except Exception as e:
            raise ModelLoadError(f"{f}: cannot be read as safetensors: {e}") from e


def load_model(
    model_dir: str,
    device: torch.device,
    dtype: torch.dtype,
    config: PretrainedConfig | None = None,  # already read by the caller
    tp: TensorParallel = SINGLE,
    quantization: str | None = None,  # "fp8": the projections quantized as they load
    lora: LoRASettings | None = None,  # adapter slots (engine/models/lora_slots.py)
    max_model_len: int | None = None,  # the rotary tables' rows (None: the model's limit)
) -> tuple[nn.Module, PretrainedConfig]:
    """This rank's shard of the model (all of it with SINGLE), weights read from disk. An
    FP8 checkpoint is read back to `dtype`; its projections go back to FP8 where the
    device has FP8 GEMMs (or `quantization` asks), else it runs in `dtype`."""
    config = config or load_config(model_dir)
    scheme = checkpoint_fp8(config)
    if quantization == "fp8":
        check_fp8_device(device)
    elif scheme is not None and fp8_supported(device):
        quantization = "fp8"
    elif scheme is not None:
        logger.info("%s: FP8 checkpoint dequantized to %s on %s", model_dir, dtype, device)
    try:
        model = build_on_meta(config, tp)
    except ValueError as e:  # a shape that does not split across the ranks
        raise ModelLoadError(f"{Path(model_dir) / 'config.json'}: {e}") from e
    # Materialise without running the random initialisers, then fill from disk; cast on
    # the meta device first, so a bf16 model never takes fp32's memory on the device.
    # Not to_empty(): empty_like of a meta tensor goes through torch._refs, whose first
    # use imports sympy (a quarter of a second); _apply is what to_empty calls.
    model = model.to(dtype)
    if quantization == "fp8":  # the projections' rows quantized as they load
        quantize_linears_at_load(model, dtype)
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    if not hasattr(model, "classifier"):  # a decoder's score head, where the checkpoint has one
        model.classifier = None
    if (Path(model_dir) / RANDOM_WEIGHTS_MARKER).is_file():
        _fill_random(model)
        return _finish(model, device, quantization, lora, max_model_len), config
    weights = iter_weights(model_dir)
    if is_multimodal(model_dir):
        weights = language_model_weights(weights)
    weights = _without_draft_layers(weights, config.num_hidden_layers)
    kv_scales: dict[int, dict[str, float]] = {}
    if scheme is not None:
        weights = dequantize_checkpoint(weights, scheme, kv_scales)
    heads: dict[str, WeightSlice] = {}  # a *ForSequenceClassification's score head
    weights = _without_heads(weights, heads)
    try:
        with staged_copies(device):
            loaded = model.load_weights(weights)
    except ModelLoadError:
        raise
    except (ValueError, RuntimeError) as e:
        raise ModelLoadError(f"{model_dir}: weights do not fit the config: {e}") from e
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if not getattr(model, "is_encoder", False):
        model.has_lm_head = not any(name.startswith("lm_head.") for name in missing)
    if "score.weight" in heads:  # its head classifies the last token (engine/pooling.py)
        score = heads["score.weight"][:]
        model.classifier = ClassifierHead(score.shape[1], score.shape[0], dense=False, bias=False)
        model.classifier.out.weight.data = score.to(device, dtype)
        model.has_lm_head = False
    if model.classifier is not None:
        labels = model.classifier.num_labels
        logger.info("%s: a classifier of %d labels: it serves /classify only", model_dir, labels)
    if missing and not model.has_lm_head and all(n.startswith("lm_head.") for n in missing):
        # The bare model, as embedding models are saved (Qwen3-Embedding-8B): it embeds
        # (engine/pooling.py) and generates nothing; its head is zeros, never read.
        model.lm_head.weight.data.zero_()
        if model.classifier is None:
            logger.warning("%s: no LM head in the checkpoint: it serves embeddings only", model_dir)
        missing = []
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelLoadError(
            f"{model_dir}: {len(missing)} weights missing from the checkpoint: {shown}"
        )
    set_kv_scales(model, kv_scales)
    return _finish(model, device, quantization, lora, max_model_len), config


# `layers.N.` at a name's start, after `model.` (or none).
LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\.")


def _without_draft_layers(
    weights: Iterator[tuple[str, WeightSlice]], num_layers: int
) -> Iterator[tuple[str, WeightSlice]]:
    """The checkpoint's tensors but its multi-token-prediction modules, which serve drafts
    that Pagoda does not make: layers past `num_layers` (DeepSeek-V3's, GLM-4.5's) and any
    `mtp*` module (ERNIE 4.5's `mtp_block`, EXAONE MoE's `mtp`), as transformers ignores them."""
    for name, weight in weights:
        if (match := LAYER.match(name)) is not None and int(match[1]) >= num_layers:
            continue
        if any(part.startswith("mtp") for part in name.split(".")):
            continue
        yield name, weight


def _without_heads(
    weights: Iterator[tuple[str, WeightSlice]], heads: dict[str, WeightSlice]
) -> Iterator[tuple[str, WeightSlice]]:
    """The checkpoint's tensors but a sequence classifier's head, which goes to `heads`."""
    for name, weight in weights:
        if name == "score.weight":
            heads[name] = weight
        else:
            yield name, weight


def load_for_engine(
    config: EngineConfig, model_dir: str, hf_config: PretrainedConfig, tp: TensorParallel
) -> nn.Module:
    """This rank's shard on the config's device, dtype and quantization, logged."""
    device, dtype = config.torch_device, config.torch_dtype(checkpoint_dtype(hf_config))
    start = time.perf_counter()
    layers, dtype_name = hf_config.num_hidden_layers, str(dtype).removeprefix("torch.")
    kind = hf_config.model_type
    logger.info(
        "loading %s (%s, %d layers) on %s in %s", model_dir, kind, layers, device, dtype_name
    )
    model, _ = load_model(
        model_dir,
        device,
        dtype,
        hf_config,
        tp,
        config.quantization,
        config.lora,
        config.max_model_len,
    )
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    seconds = time.perf_counter() - start
    logger.info("weights loaded: %.2f GiB in %.1f s", weights / 2**30, seconds)
    return model


def _finish(
    model: nn.Module,
    device: torch.device,
    quantization: str | None,
    lora: LoRASettings | None,
    max_model_len: int | None,
) -> nn.Module:
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.build_cache(device, max_model_len)
    # Before quantizing: the adapters read the projections' sections, which FP8 drops.
    model.lora_slots = None
    if lora is not None:
        try:
            model.lora_slots = LoRASlots.attach(model, lora)
        except LoRAError as e:
            raise ModelLoadError(str(e)) from e
    if quantization == "fp8":
        count = quantize_model(model)
        if device.type == "cuda":  # hand the model-dtype weights back before KV sizing
            torch.cuda.empty_cache()
        logger.info("quantized %d projections to FP8 (e4m3, per-channel scales)", count)
    return model.eval()


# Elements drawn at once by fill_random_ (fp32 temporaries of at most 256 MiB).
RANDOM_CHUNK = 1 << 26


@torch.no_grad()
def _fill_random(model: nn.Module) -> None:
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    for name, param in model.named_parameters():
        if param.dtype != FP8_DTYPE:
            fill_random_(name, param, gen)
            continue
        # Quantized at load: the model-dtype weights' draw, quantized a chunk at a time.
        module, _, leaf = name.rpartition(".")
        module = model.get_submodule(module)
        fill_random_(name, param, gen, getattr(module, f"{leaf}_scale"), module.load_dtype)


def fill_random_(
    name: str,
    tensor: torch.Tensor,
    gen: torch.Generator,
    scale: torch.Tensor | None = None,  # an e4m3 tensor's row scales (tensor.shape[:-1])
    dtype: torch.dtype | None = None,  # with scale: the model dtype it is quantized from
) -> None:
    """Norm weights 1, matrices, biases and sinks N(0, 0.02): finite activations and
    near-uniform routing (biases of 1 would add one vector to every token's residual
    stream, layer after layer, until every token picked the same experts). Drawn in
    fp32 and cast, a chunk of rows at a time: CUDA's normal_ draws differently per dtype,
    and a bf16 and an fp32 model should hold the same weights. An e4m3 tensor takes the
    draw in `dtype` quantized per row: the bytes quantizing the `dtype` model gives."""
    if tensor.dim() == 1 and not name.endswith(("bias", "sinks")):
        tensor.fill_(1.0)
        return
    rows = max(1, RANDOM_CHUNK // max(1, tensor[0].numel())) if tensor.dim() > 1 else None
    parts = tensor.split(rows) if rows else [tensor]
    scales = [None] * len(parts) if scale is None else scale.split(rows)
    for part, part_scale in zip(parts, scales, strict=True):
        draw = torch.empty(part.shape, dtype=torch.float32, device=part.device)
        draw.normal_(0.0, 0.02, generator=gen)
        if part_scale is None:
            part.copy_(draw)
        else:
            fill_quantized(part, part_scale, draw.to(dtype), dtype)


def load_tokenizer(model_dir: str) -> PreTrainedTokenizerBase:
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"{model_dir}: cannot load the tokenizer: {e}") from e
    processor = Path(model_dir) / "chat_template.json"
    if not getattr(tokenizer, "chat_template", None) and processor.is_file():
        # A multimodal checkpoint may keep its chat template with its processor only.
        try:
            tokenizer.chat_template = json.loads(processor.read_text())["chat_template"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{processor}: cannot read its chat_template: {e}") from e
    return tokenizer
