"""Images in prompts (engine/images.py, engine/models/vision.py): for LLaVA (CLIP tower)
and Mistral Small 3.1 (Pixtral tower, patch merger), greedy output equals transformers'
generate on the same ids and pixel values, whole and in chunks that split an image;
the prefix cache tells two images apart; placeholders that do not match the images,
and images for a text-only model, are refused."""

from __future__ import annotations

import functools

import pytest
import torch

from engine import SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from engine.images import ImageInputs
from engine.models.vision import EncoderCache
from tests.engine.test_multimodal_text import build

MAX_NEW = 12


def image_inputs(kind: str, seed: int) -> tuple[ImageInputs, int]:
    """Random pixel values for one image, and the placeholders it takes."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "mistral3":  # 32 x 48 in patches of 8, merged 2 x 2: 2 x 3 features
        sizes = {"image_sizes": torch.tensor([[32, 48]])}
        return ImageInputs(torch.randn(1, 3, 32, 48, generator=gen), sizes), 6
    if kind == "gemma3":  # 4 x 4 patches pooled to 2 x 2
        return ImageInputs(torch.randn(1, 3, 32, 32, generator=gen)), 4
    if kind.startswith("qwen"):  # a 4 x 6 grid of patches, merged 2 x 2: 2 x 3
        grid = {"image_grid_thw": torch.tensor([[1, 4, 6]])}
        return ImageInputs(torch.randn(24, 3 * 2 * 4 * 4, generator=gen), grid), 6
    return ImageInputs(torch.randn(1, 3, 32, 32, generator=gen)), 16  # 4 x 4 patches, CLS dropped


@pytest.fixture(scope="module")
def vlm_of(tmp_path_factory, tokenizer):
    """kind -> (kind, checkpoint dir, prompt ids with one image's placeholders,
    transformers' model), each built once."""

    @functools.cache
    def make(kind: str):
        path = tmp_path_factory.mktemp(f"{kind}-images")
        model = build(kind, path, tokenizer)
        model.generation_config.eos_token_id = None
        _, count = image_inputs(kind, 0)
        image = model.config.image_token_id
        ids = tokenizer.encode("look at") + [image] * count + tokenizer.encode(" and say what")
        return kind, path, ids, model

    return make


@pytest.fixture(
    params=["gemma3", "llava", "mistral3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]
)
def vlm(request, vlm_of):
    return vlm_of(request.param)


def reference(model, ids: list[int], images: ImageInputs) -> list[int]:
    x = torch.tensor([ids])
    extra = dict(images.extra)
    if model.config.model_type == "gemma3":  # its image tokens attend both ways
        extra["token_type_ids"] = (x == model.config.image_token_id).long()
    if "image_grid_thw" in extra:  # the Qwen VL models' 3-D positions read the image tokens
        extra["mm_token_type_ids"] = (x == model.config.image_token_id).int()
    with torch.no_grad():
        out = model.generate(
            x, attention_mask=torch.ones_like(x), pixel_values=images.pixel_values,
            max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0, **extra,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


def run(engine: Engine, requests: dict[str, tuple[list[int], ImageInputs | None]]) -> dict:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    for rid, (ids, images) in requests.items():
        engine.add_request(rid, ids, params, images=images)
    got: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    return got


@pytest.mark.parametrize("budget", [2048, 8])  # 8: chunks that cut through the image
def test_greedy_output_with_images_equals_transformers(vlm, budget):
    kind, path, ids, model = vlm
    first, _ = image_inputs(kind, 1)
    second, _ = image_inputs(kind, 2)
    config = EngineConfig(model=str(path), device="cpu", max_num_batched_tokens=budget)
    got = run(Engine(config), {"a": (ids, first), "b": (ids, second), "text": (ids, None)})
    assert got["a"] == reference(model, ids, first)
    assert got["b"] == reference(model, ids, second)
    assert got["a"] != got["b"]  # the images, not the text, made the difference


def test_the_prefix_cache_tells_images_apart(vlm):
    kind, path, ids, model = vlm
    first, _ = image_inputs(kind, 1)
    second, _ = image_inputs(kind, 2)
    engine = Engine(EngineConfig(model=str(path), device="cpu", block_size=4))
    assert run(engine, {"a": (ids, first)})["a"] == reference(model, ids, first)
    hits = engine.get_stats().prefix_cache_hits
    # The same text with another image finds nothing cached; the same image finds its blocks.
    assert run(engine, {"b": (ids, second)})["b"] == reference(model, ids, second)
    assert engine.get_stats().prefix_cache_hits == hits
    again = ImageInputs(first.pixel_values.clone(), first.extra)
    assert run(engine, {"c": (ids, again)})["c"] == reference(model, ids, first)
    assert engine.get_stats().prefix_cache_hits > hits


def test_placeholders_must_match_the_images(vlm):
    kind, path, ids, _ = vlm
    engine = Engine(EngineConfig(model=str(path), device="cpu"))
    images, count = image_inputs(kind, 1)
    ids = ids + [engine.vision.image_token_id] * count  # two images' placeholders, one image
    with pytest.raises(ValueError, match="image placeholder tokens"):
        engine.add_request("x", ids, SamplingParams(), images=images)


def test_a_text_model_takes_no_images(tiny_llama_dir):
    engine = Engine(EngineConfig(model=tiny_llama_dir, device="cpu"))
    images, _ = image_inputs("llava", 1)
    with pytest.raises(ValueError, match="takes no images"):
        engine.add_request("x", [1, 2, 3], SamplingParams(), images=images)


@pytest.mark.parametrize("kind", ["gemma3", "qwen3_vl"])
def test_tensor_parallel_ranks_receive_the_image_rows(vlm_of, kind):
    """Rank 0 alone encodes; the other rank gets the step's image rows, features and
    horizons (Gemma 3's, whose image tokens see their whole image) or 3-D positions and
    deepstack features (Qwen3-VL's)."""
    kind, path, ids, model = vlm_of(kind)
    images, count = image_inputs(kind, 1)
    config = EngineConfig(
        model=str(path), device="cpu", tensor_parallel_size=2, max_num_batched_tokens=count + 1
    )
    engine = Engine(config)
    try:
        got = run(engine, {"a": (ids, images)})["a"]
    finally:
        engine.shutdown()
    assert got == reference(model, ids, images)


def test_gemma3_images_are_never_split_between_steps(vlm_of):
    """Gemma 3's image tokens see their whole image: over budgets that would cut each
    image somewhere, chunks stop before it instead, and the output stays transformers';
    a request again finds its prefix cached (a hit may end inside an image)."""
    kind, path, ids, model = vlm_of("gemma3")
    first, count = image_inputs(kind, 1)
    second, _ = image_inputs(kind, 2)
    both = ImageInputs(torch.cat([first.pixel_values, second.pixel_values]))
    prompt = ids + ids  # two images, text between
    want = reference(model, prompt, both)
    for budget in range(count, count + 4):
        engine = Engine(
            EngineConfig(model=str(path), device="cpu", max_num_batched_tokens=budget, block_size=4)
        )
        assert run(engine, {"a": (prompt, both), "text": (ids, None)})["a"] == want, budget
        hits = engine.get_stats().prefix_cache_hits
        assert run(engine, {"b": (prompt, both)})["b"] == want, budget
        assert engine.get_stats().prefix_cache_hits > hits
    small = Engine(EngineConfig(model=str(path), device="cpu", max_num_batched_tokens=count - 1))
    with pytest.raises(ValueError, match="does not fit one step"):
        small.add_request("x", prompt, SamplingParams(), images=both)


def test_a_burst_of_requests_encodes_its_images_in_one_call(vlm, monkeypatch):
    """vision.prefetch (the engine loop's, for the adds of one drain): one call of the
    tower for requests whose images have one shape, each request then handed its own
    features, the same as encoding it alone gives."""
    kind, path, ids, model = vlm
    engine = Engine(EngineConfig(model=str(path), device="cpu"))
    first, _ = image_inputs(kind, 1)
    second, _ = image_inputs(kind, 2)
    alone = [engine.vision.encode(images) for images in (first, second)]
    engine.vision.cache = EncoderCache()  # forgotten: the burst below encodes them again
    calls = []
    tower = engine.vision._tower
    monkeypatch.setattr(engine.vision, "_tower", lambda batch: calls.append(batch) or tower(batch))
    engine.vision.prefetch([first, second])
    assert len(calls) == 1 and len(calls[0]) == 2
    for images, (features, deepstack) in zip((first, second), alone, strict=True):
        got, got_deepstack = engine.vision.encode(images)
        torch.testing.assert_close(got, features)
        for level, want in zip(got_deepstack or [], deepstack or [], strict=True):
            torch.testing.assert_close(level, want)
    assert len(calls) == 1  # handed out, not encoded again
    engine.vision.prefetch([first, second])
    got = run(engine, {"a": (ids, first), "b": (ids, second)})
    assert got["a"] == reference(model, ids, first) and got["b"] == reference(model, ids, second)
