"""Build a model from a local Hugging Face directory: config, safetensors, tokenizer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from engine.distributed import SINGLE, TensorParallel
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.gpt2 import GPT2ForCausalLM
from engine.models.layers import RotaryEmbedding
from engine.models.llama import LlamaForCausalLM
from engine.models.moe import MoeForCausalLM

MODEL_TYPES: dict[str, type[nn.Module]] = {
    "gpt2": GPT2ForCausalLM,
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "phi3": LlamaForCausalLM,
    "qwen3_moe": MoeForCausalLM,
    "mixtral": MoeForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
}


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
    if config.model_type not in MODEL_TYPES:
        raise ModelLoadError(
            f"{path / 'config.json'}: unsupported architecture {config.model_type!r} "
            f"({', '.join(getattr(config, 'architectures', None) or [])}); "
            f"supported model types: {', '.join(sorted(MODEL_TYPES))}"
        )
    check = getattr(MODEL_TYPES[config.model_type], "check_config", None)
    try:
        if check is not None:
            check(config)
        with torch.device("meta"):  # builds the rotary embeddings, which check rope_scaling
            MODEL_TYPES[config.model_type](config)
    except ValueError as e:
        raise ModelLoadError(f"{path / 'config.json'}: {e}") from e
    return config


def max_model_len(config: PretrainedConfig) -> int:
    """The longest context the model handles exactly."""
    return getattr(config, "n_positions", None) or config.max_position_embeddings


def checkpoint_dtype(config: PretrainedConfig) -> torch.dtype | None:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def safetensors_files(model_dir: str) -> list[Path]:
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
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights found")
    return files


def iter_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    for f in safetensors_files(model_dir):
        try:
            with safe_open(str(f), framework="pt", device="cpu") as reader:
                for name in reader.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, reader.get_tensor(name)
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"{f}: cannot be read as safetensors: {e}") from e


def load_model(
    model_dir: str,
    device: torch.device,
    dtype: torch.dtype,
    config: PretrainedConfig | None = None,  # already read by the caller
    tp: TensorParallel = SINGLE,  # each rank holds the full model until layers shard
) -> tuple[nn.Module, PretrainedConfig]:
    config = config or load_config(model_dir)
    with torch.device("meta"):
        model = MODEL_TYPES[config.model_type](config)
    # Materialise without running the random initialisers, then fill from disk; cast on
    # the meta device first, so a bf16 model never takes fp32's memory on the device.
    model = model.to(dtype).to_empty(device=device)
    if (Path(model_dir) / RANDOM_WEIGHTS_MARKER).is_file():
        _fill_random(model)
        return _finish(model, device), config
    try:
        loaded = model.load_weights(iter_weights(model_dir))
    except ModelLoadError:
        raise
    except (ValueError, RuntimeError) as e:
        raise ModelLoadError(f"{model_dir}: weights do not fit the config: {e}") from e
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelLoadError(
            f"{model_dir}: {len(missing)} weights missing from the checkpoint: {shown}"
        )
    return _finish(model, device), config


def _finish(model: nn.Module, device: torch.device) -> nn.Module:
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.build_cache(device)
    return model.eval()


@torch.no_grad()
def _fill_random(model: nn.Module) -> None:
    """Norm weights 1, matrices small normals: finite activations and near-uniform routing."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    for param in model.parameters():
        if param.dim() == 1:
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=gen)


def load_tokenizer(model_dir: str) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"{model_dir}: cannot load the tokenizer: {e}") from e
