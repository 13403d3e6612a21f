"""Multimodal checkpoints (Gemma3ForConditionalGeneration, as gemma-3-4b-it and up are
published; Mistral3ForConditionalGeneration, Mistral Small 3.1's) served as their
language model: greedy output equal to transformers' on text prompts, under either
naming of their tensors; a quantized one refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.models.loader import ModelLoadError, checkpoint_dtype, load_config
from tests.conftest import FAMILY_CONFIGS, PROMPTS, TINY

MAX_NEW = 16


# kind -> (the text model's FAMILY_CONFIGS kind, the wrapper's config and model classes)
WRAPPERS = {
    "gemma3": ("gemma3", "Gemma3Config", "Gemma3ForConditionalGeneration"),
    "mistral3": ("mistral", "Mistral3Config", "Mistral3ForConditionalGeneration"),
}


def build(kind: str, path, tokenizer) -> object:
    """A tiny multimodal checkpoint of `kind` saved at path; its transformers model."""
    import transformers

    family, config_class, model_class = WRAPPERS[kind]
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    text_class, _, fields = FAMILY_CONFIGS[family]
    text = getattr(transformers, text_class)(
        **TINY, **fields, vocab_size=vocab, bos_token_id=eos, eos_token_id=eos
    )
    vision = dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
        image_size=32, patch_size=8,
    )  # fmt: skip
    if kind == "gemma3":
        vision = transformers.SiglipVisionConfig(**vision)
        extra = dict(mm_tokens_per_image=4, boi_token_index=vocab - 2, eoi_token_index=vocab - 3)
    else:  # with a head of its own, as Mistral Small 3.1's checkpoint has
        vision = transformers.PixtralVisionConfig(**vision, head_dim=16)
        extra = dict(spatial_merge_size=2, tie_word_embeddings=False)
    config = getattr(transformers, config_class)(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        image_token_index=vocab - 1,
        initializer_range=0.2,
        **extra,
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=list(WRAPPERS))
def multimodal(request, tmp_path_factory, tokenizer):
    """(checkpoint dir, transformers' greedy ids for PROMPTS[:4])."""
    path = tmp_path_factory.mktemp(f"{request.param}-multimodal")
    model = build(request.param, path, tokenizer)
    model.generation_config.eos_token_id = None  # ignore EOS without masking it
    want = []
    for prompt in PROMPTS[:4]:
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
        want.append(out[0, ids.shape[1] :].tolist())
    return path, want


def greedy_ids(model_dir) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = LLM(str(model_dir), device="cpu").generate(PROMPTS[:4], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_a_multimodal_checkpoint_serves_its_language_model(multimodal, tmp_path):
    path, want = multimodal
    names = load_file(path / "model.safetensors")
    assert any(n.startswith("language_model.model.") for n in names)  # the published naming
    assert any(n.startswith("vision_tower.") for n in names)
    assert any(n.endswith("lm_head.weight") for n in names) == (path.name[:8] == "mistral3")
    # The language model's config, with the checkpoint's dtype (the outer config's).
    config = load_config(str(path))
    assert config.model_type in ("gemma3_text", "mistral") and not hasattr(config, "text_config")
    assert checkpoint_dtype(config) == torch.float32
    assert greedy_ids(path) == want
    # Newer saves nest both under `model.`: the same model.
    newer = tmp_path / "newer"
    shutil.copytree(path, newer)
    renamed = {
        n.replace("language_model.model.", "model.language_model.")
        .replace("language_model.lm_head.", "lm_head.")
        .replace("vision_tower.", "model.vision_tower.")
        .replace("multi_modal_projector.", "model.multi_modal_projector."): t
        for n, t in names.items()
    }
    save_file(renamed, newer / "model.safetensors")
    assert greedy_ids(newer) == want


def test_a_quantized_multimodal_checkpoint_is_refused(multimodal, tmp_path):
    path, _ = multimodal
    shutil.copytree(path, tmp_path / "fp8")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="quantized multimodal"):
        LLM(str(tmp_path / "fp8"), device="cpu")
