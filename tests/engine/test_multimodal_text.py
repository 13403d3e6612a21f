"""Multimodal checkpoints (Gemma3ForConditionalGeneration, as gemma-3-4b-it and up are
published; Gemma 4's; Llama 4's Llama4ForConditionalGeneration; EXAONE 4.5's; Mistral Small 3.1's
Mistral3ForConditionalGeneration; Qwen2-VL, Qwen2.5-VL,
Qwen3-VL and Qwen3-VL-MoE (its experts stacked either way), whose multimodal rotary sections see one position per text token;
Qwen 3.5 and Qwen 3.5 MoE) served as
their language model: greedy output equal to transformers' on text prompts, under either
naming of their tensors; a quantized one refused by name; a chat template kept with the
processor (chat_template.json) read."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.models.loader import ModelLoadError, checkpoint_dtype, load_config, load_tokenizer
from tests.reference import PROMPTS
from tests.tiny_checkpoints import FAMILY_CONFIGS, TINY

MAX_NEW = 16


# kind -> the wrapper's config and model classes
WRAPPERS = {
    "exaone4_5": ("Exaone4_5_Config", "Exaone4_5_ForConditionalGeneration"),
    "gemma3": ("Gemma3Config", "Gemma3ForConditionalGeneration"),
    "gemma4": ("Gemma4Config", "Gemma4ForConditionalGeneration"),
    "llama4": ("Llama4Config", "Llama4ForConditionalGeneration"),
    "llava": ("LlavaConfig", "LlavaForConditionalGeneration"),
    "mistral3": ("Mistral3Config", "Mistral3ForConditionalGeneration"),
    # Mistral 4's language model (DeepSeek-V3's layers) in the same wrapper.
    "mistral3_mistral4": ("Mistral3Config", "Mistral3ForConditionalGeneration"),
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
    "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration"),
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration"),
}
SMALL_VISION = dict(hidden_size=32, intermediate_size=48)


def wrapper_config(kind: str, vocab: int, eos: int) -> dict:
    """The wrapper's config arguments: its text model (from FAMILY_CONFIGS where the
    family has one), a tiny vision tower, its special tokens."""
    import transformers

    common = dict(**TINY, vocab_size=vocab, bos_token_id=eos, eos_token_id=eos)
    if kind == "llama4":  # Llama 4 Scout's layout, its tower's tensors under vision_model.
        text = transformers.Llama4TextConfig(**(common | FAMILY_CONFIGS[kind][2]))
        vision = dict(SMALL_VISION, num_hidden_layers=1, num_attention_heads=2, image_size=32)
        vision |= dict(patch_size=8, vision_output_dim=32, pixel_shuffle_ratio=0.5)
        vision |= dict(projector_input_dim=64, projector_output_dim=64)
        tokens = dict(boi_token_index=vocab - 2, eoi_token_index=vocab - 3)
        return dict(
            text_config=text.to_dict(), vision_config=vision, image_token_index=vocab - 1, **tokens
        )
    if kind == "exaone4_5":  # EXAONE 4's text model (1-D positions), Qwen2.5-VL's tower
        text = transformers.Exaone4Config(**(common | FAMILY_CONFIGS["exaone4"][2]))
        vision = dict(SMALL_VISION, depth=1, num_heads=2, out_hidden_size=64, patch_size=4)
        vision |= dict(spatial_merge_size=2, temporal_patch_size=2, window_size=16)
        tokens = dict(image_token_id=vocab - 1, video_token_id=vocab - 2)
        return dict(text_config=text.to_dict(), vision_config=vision, **tokens)
    if kind == "gemma4":  # its own tower, under model.vision_tower and model.embed_vision
        text = transformers.Gemma4TextConfig(**(common | FAMILY_CONFIGS[kind][2]))
        vision = dict(SMALL_VISION, num_hidden_layers=1, num_attention_heads=2, head_dim=16)
        vision |= dict(num_key_value_heads=2, patch_size=8)
        return dict(text_config=text.to_dict(), vision_config=vision, image_token_id=vocab - 1)
    if kind in ("qwen3_5", "qwen3_5_moe"):  # Gated DeltaNet layers; a Qwen3-VL-like tower
        text_class, _, fields = FAMILY_CONFIGS[kind]
        text = getattr(transformers, text_class)(**(common | fields), initializer_range=0.2)
        vision = dict(SMALL_VISION, depth=1, num_heads=2, out_hidden_size=64, patch_size=4)
        vision |= dict(num_position_embeddings=16)
        tokens = dict(image_token_id=vocab - 1, video_token_id=vocab - 2)
        tokens |= dict(vision_start_token_id=vocab - 3, vision_end_token_id=vocab - 4)
        return dict(text_config=text.to_dict(), vision_config=vision, **tokens)
    if kind in ("gemma3", "llava", "mistral3", "mistral3_mistral4"):
        families = {"gemma3": "gemma3", "mistral3": "mistral", "mistral3_mistral4": "mistral4"}
        family = families.get(kind)
        text_class, _, fields = FAMILY_CONFIGS[family] if family else ("LlamaConfig", 0, {})
        text = getattr(transformers, text_class)(**(common | fields)).to_dict()
        vision = dict(SMALL_VISION, num_hidden_layers=1, num_attention_heads=2, image_size=32)
        vision["patch_size"] = 8
        if kind == "llava":  # CLIP's tower, its CLS row dropped
            vision = transformers.CLIPVisionConfig(**vision).to_dict()
            return dict(text_config=text, vision_config=vision, image_token_index=vocab - 1)
        if kind == "gemma3":
            vision = transformers.SiglipVisionConfig(**vision).to_dict()
            extra = dict(
                mm_tokens_per_image=4, boi_token_index=vocab - 2, eoi_token_index=vocab - 3
            )
            return dict(
                text_config=text, vision_config=vision, image_token_index=vocab - 1, **extra
            )
        # With a head of its own, as Mistral Small 3.1's checkpoint has.
        vision = transformers.PixtralVisionConfig(**vision, head_dim=16).to_dict()
        extra = dict(spatial_merge_size=2, tie_word_embeddings=False)
        return dict(text_config=text, vision_config=vision, image_token_index=vocab - 1, **extra)
    # Qwen VL: multimodal rotary sections (interleaved in Qwen3-VL's), q/k norm in Qwen3's.
    # A small theta: every section's frequencies turn enough for its positions to count.
    rope = {"rope_type": "default", "rope_theta": 10.0, "mrope_section": [2, 3, 3]}
    vision = dict(SMALL_VISION, depth=1, num_heads=2, out_hidden_size=64, patch_size=4)
    vision |= dict(spatial_merge_size=2, temporal_patch_size=2)
    if kind in ("qwen3_vl", "qwen3_vl_moe"):
        rope["mrope_interleaved"] = True
        common["head_dim"] = 16
        vision |= dict(deepstack_visual_indexes=[0], num_position_embeddings=16)
        vision["initializer_range"] = 0.2  # deepstack features large enough to count
        if kind == "qwen3_vl_moe":  # 4 experts stacked in one tensor, top 2
            common |= dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    elif kind == "qwen2_vl":
        vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=4)
        vision |= dict(spatial_merge_size=2, temporal_patch_size=2)
    else:
        vision |= dict(window_size=16, fullatt_block_indexes=[0])
    tokens = dict(image_token_id=vocab - 1, video_token_id=vocab - 2)
    tokens |= dict(vision_start_token_id=vocab - 3, vision_end_token_id=vocab - 4)
    # The text model's own initializer_range: the outer config's does not reach it, and
    # with its default (0.02) attention is too flat for the 3-D positions to count.
    text = dict(common, rope_scaling=rope, initializer_range=0.2)
    return dict(text_config=text, vision_config=vision, **tokens)


def build(kind: str, path, tokenizer) -> object:
    """A tiny multimodal checkpoint of `kind` saved at path; its transformers model."""
    import transformers

    config_class, model_class = WRAPPERS[kind]
    fields = wrapper_config(kind, len(tokenizer), tokenizer.eos_token_id)
    config = getattr(transformers, config_class)(**fields, initializer_range=0.2)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # Gemma 3 starts its projection at zero: images would not count
        for name, param in model.named_parameters():
            if "multi_modal_projector" in name and not param.any():
                param.normal_(std=0.2)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=list(WRAPPERS))
def multimodal(request, tmp_path_factory, tokenizer):
    """(checkpoint dir, transformers' greedy ids for PROMPTS[:4], kind)."""
    path = tmp_path_factory.mktemp(f"{request.param}-multimodal")
    model = build(request.param, path, tokenizer)
    if request.param == "llama4":  # its wrapper's forward fails on text (no image_outputs)
        model = model.language_model
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
    return path, want, request.param


def renamed_tensor(name: str) -> str:
    """A wrapper's tensor under the naming it was not saved with: `language_model.model.`
    and top-level towers (the published checkpoints') <-> all of it under `model.`."""
    if name.startswith("language_model.model."):
        return "model.language_model." + name.removeprefix("language_model.model.")
    if name.startswith("model.language_model."):
        return "language_model.model." + name.removeprefix("model.language_model.")
    towers = ("vision_tower.", "multi_modal_projector.", "visual.", "vision_model.")
    if name.startswith(towers):
        return "model." + name
    if name.startswith(tuple(f"model.{tower}" for tower in towers)):
        return name.removeprefix("model.")
    return name.replace("language_model.lm_head.", "lm_head.")


def published_layout(kind: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Stacked experts as Qwen3-VL-MoE's published checkpoints hold them, each expert's
    matrix transposed ([experts, hidden, 2 * inter]); transformers 5 saves the other way,
    as Mistral 4's are published."""
    stacked = name.endswith(("experts.gate_up_proj", "experts.down_proj"))
    return tensor.transpose(1, 2).contiguous() if stacked and kind == "qwen3_vl_moe" else tensor


def greedy_ids(model_dir) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = LLM(str(model_dir), device="cpu").generate(PROMPTS[:4], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_a_multimodal_checkpoint_serves_its_language_model(multimodal, tmp_path):
    path, want, kind = multimodal
    assert len({token for ids in want for token in ids}) > 4  # not one repeated token
    names = load_file(path / "model.safetensors")
    towers = ("vision_tower.", "model.vision_tower.", "visual.", "model.visual.", "vision_model.")
    assert any(n.startswith(towers) for n in names)
    # The language model's config, with the checkpoint's dtype (the outer config's).
    config = load_config(str(path))
    assert not hasattr(config, "text_config") and checkpoint_dtype(config) == torch.float32
    assert greedy_ids(path) == want
    # The other naming (transformers 5 saves Gemma 3's and Mistral 3's the published way,
    # `language_model.model.`, and Qwen3-VL's nested under `model.`): the same model.
    other = tmp_path / "other"
    shutil.copytree(path, other)
    renamed = {renamed_tensor(n): published_layout(kind, n, t) for n, t in names.items()}
    assert renamed.keys() != names.keys()
    save_file(renamed, other / "model.safetensors")
    assert greedy_ids(other) == want


def test_a_quantized_multimodal_checkpoint_is_refused(multimodal, tmp_path):
    path, _, _ = multimodal
    shutil.copytree(path, tmp_path / "fp8")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="quantized multimodal"):
        LLM(str(tmp_path / "fp8"), device="cpu")


def test_a_chat_template_kept_with_the_processor_only_is_read(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path / "ct")
    (tmp_path / "ct" / "chat_template.jinja").unlink(missing_ok=True)
    settings = json.loads((tmp_path / "ct" / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (tmp_path / "ct" / "tokenizer_config.json").write_text(json.dumps(settings))
    assert not load_tokenizer(str(tmp_path / "ct")).chat_template
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    (tmp_path / "ct" / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    loaded = load_tokenizer(str(tmp_path / "ct"))
    messages = [{"role": "user", "content": "hi"}]
    assert loaded.apply_chat_template(messages, tokenize=False) == "<user>hi"
