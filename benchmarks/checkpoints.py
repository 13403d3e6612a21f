"""Random-weight checkpoints at real sizes, for benchmarks (speed does not depend on values).

No model hub is reachable, so the tokenizer is synthetic too: a byte-level BPE
whose merges are drawn deterministically until it has the model's vocabulary
size. It encodes and decodes like a real one; its tokens just mean nothing.
Merges join printable ASCII only, so that, as in GPT-2's vocabulary, almost
every token is whole text: random ids then decode to valid UTF-8 as a real
model's output does, and detokenization costs what it costs in real use.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from benchmarks.shapes import CONFIGS, ENCODERS, ON_DEVICE

EOS = "<|endoftext|>"


def synthetic_tokenizer(vocab_size: int, seed: int = 0):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    # ByteLevel shows printable ASCII as itself and the space as "Ġ".
    text = [c for c in alphabet if c.isascii() and c.isprintable()] + ["Ġ"]
    tokens = list(text)
    merges: list[tuple[str, str]] = []
    rng = random.Random(seed)
    while len(vocab) < vocab_size - 1:
        a, b = rng.choice(tokens), rng.choice(text)
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
            merges.append((a, b))
            tokens.append(a + b)
    vocab[EOS] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS)


def build_checkpoint(name: str, path: Path, dtype: torch.dtype = torch.float16) -> str:
    """Save a random checkpoint + tokenizer under path (skipped if already there)."""
    from transformers import AutoModel, AutoModelForCausalLM

    from engine.models.loader import RANDOM_WEIGHTS_MARKER

    path = Path(path)
    if (path / "config.json").is_file():
        return str(path)
    config = CONFIGS[name]()
    tokenizer = synthetic_tokenizer(min(config.vocab_size, 50257))
    config.eos_token_id = config.bos_token_id = tokenizer.eos_token_id
    if name in ON_DEVICE:
        config.dtype = dtype
        config.save_pretrained(path)
        (path / RANDOM_WEIGHTS_MARKER).write_text("weights drawn at load; see loader.py\n")
    else:
        torch.manual_seed(0)
        auto = AutoModel if name in ENCODERS else AutoModelForCausalLM
        model = auto.from_config(config, dtype=dtype)
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def model_dir(model: str, dtype: str) -> str:
    """`model` if it is a directory, else a shape's random checkpoint (build_checkpoint)
    under /tmp/pagoda-bench-<model>, built once."""
    import tempfile

    if Path(model).is_dir():
        return model
    path = Path(tempfile.gettempdir()) / f"pagoda-bench-{model}"
    return build_checkpoint(model, path, getattr(torch, dtype))


SHARD_BYTES = 4 << 30


def disk_checkpoint(name: str, dtype: str = "bfloat16", path: str | None = None) -> str:
    """A checkpoint of `name` with every weight on disk (for what reads them: time to
    ready, transformers), under path or /tmp/pagoda-disk-<name> (reused if there).
    The ON_DEVICE sizes get random shards (write_random_shards); the others are
    build_checkpoint's."""
    import tempfile

    target = Path(path or Path(tempfile.gettempdir()) / f"pagoda-disk-{name}")
    if (target / "config.json").is_file():
        return str(target)
    if name not in ON_DEVICE:
        return build_checkpoint(name, target, getattr(torch, dtype))
    write_random_shards(name, target, getattr(torch, dtype))
    return str(target)


def write_random_shards(name: str, path: Path, dtype: torch.dtype) -> None:
    """`name`'s shapes, weights drawn by the loader's random fill (`fill_random_`: norm
    weights 1, the rest N(0, 0.02)) in transformers' order, written as safetensors
    shards of up to 4 GiB. Drawn on the GPU when there is one: an 8B model's 16 GB in
    seconds, not minutes."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from engine.models.loader import fill_random_

    config = CONFIGS[name]()
    tokenizer = synthetic_tokenizer(min(config.vocab_size, 50257))
    config.eos_token_id = config.bos_token_id = tokenizer.eos_token_id
    config.dtype = dtype
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    tmp = path.with_name(path.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    items = list(model.state_dict().items())
    if config.tie_word_embeddings:
        items = [(k, v) for k, v in items if k != "lm_head.weight"]
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    size = 0
    for i, (key, meta) in enumerate(items):
        t = torch.empty(meta.shape, dtype=dtype, device=device)
        fill_random_(key, t, gen)
        shard[key] = t.cpu()
        size += t.numel() * t.element_size()
        if size >= SHARD_BYTES or i == len(items) - 1:
            fname = f"model-{len(set(weight_map.values())):05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
            shard, size = {}, 0
    index = {"metadata": {}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(path)  # whole or not at all: a killed write is never reused


# PEFT's names for a Llama-shaped layer's projections, and which dimension of the layer
# each one reads and writes (hidden, q / kv heads' width, intermediate).
LORA_SHAPES = {
    "self_attn.q_proj": ("hidden", "q"),
    "self_attn.k_proj": ("hidden", "kv"),
    "self_attn.v_proj": ("hidden", "kv"),
    "self_attn.o_proj": ("q", "hidden"),
    "mlp.gate_proj": ("hidden", "inter"),
    "mlp.up_proj": ("hidden", "inter"),
    "mlp.down_proj": ("inter", "hidden"),
}


def write_random_adapters(model_dir: str, count: int, rank: int) -> dict[str, str]:
    """`count` PEFT LoRA adapters of a Llama-shaped checkpoint, every projection at
    `rank`, N(0, 0.02) weights (as peft saves them; its timing does not depend on values):
    name -> directory, beside the checkpoint."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    width = {
        "hidden": config.hidden_size,
        "q": config.num_attention_heads * head_dim,
        "kv": config.num_key_value_heads * head_dim,
        "inter": config.intermediate_size,
    }
    gen = torch.Generator().manual_seed(0)
    adapters = {}
    for i in range(count):
        path = Path(f"{model_dir.rstrip('/')}-lora{i}-r{rank}")
        path.mkdir(exist_ok=True)
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for module, (fan_in, fan_out) in LORA_SHAPES.items():
                key = f"base_model.model.model.layers.{layer}.{module}"
                a = torch.randn(rank, width[fan_in], generator=gen) * 0.02
                b = torch.randn(width[fan_out], rank, generator=gen) * 0.02
                tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
                tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16)
        save_file(tensors, path / "adapter_model.safetensors")
        targets = sorted({m.rpartition(".")[2] for m in LORA_SHAPES})
        config_json = dict(peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=targets)
        (path / "adapter_config.json").write_text(json.dumps(config_json))
        adapters[f"lora{i}"] = str(path)
    return adapters
