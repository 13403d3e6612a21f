"""Images through the engine, a tiny LLaVA's: the engine loop encodes a drain's images
in one call, a sent-again image's features come from the encoder cache, and LLM.chat
reads images by file URL, PIL image, data URL and http URL; each answer is
transformers'."""

from __future__ import annotations

import io

import pytest

from engine.engine import Engine
from tests.server.live_server import engine_config
from tests.server.tiny_llava import (
    MAX_NEW,
    data_url,
    expected,
    greedy_of,
    image_part,
    png,
)


def test_the_engine_loop_encodes_a_drains_images_together(llava, monkeypatch):
    """Two adds with images in one drain: one call of the tower, and each request runs
    with its own image's features (its answer is transformers')."""
    from engine.sampling_params import SamplingParams
    from server.engine_loop import Add, EngineLoop
    from server.images import ImageProcessor

    path, model, _ = llava
    loop = EngineLoop(engine_config(str(path)), Engine, lambda report: None)
    engine = loop.build()
    processor = ImageProcessor(str(path), "llava", engine.tokenizer)
    prompts = [processor("look <image> here", [data_url(png(seed))]) for seed in (5, 6)]
    calls = []
    tower = engine.vision._tower
    monkeypatch.setattr(engine.vision, "_tower", lambda batch: calls.append(batch) or tower(batch))
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    adds = [Add(f"r{i}", p.token_ids, params, 0.0, p.images) for i, p in enumerate(prompts)]
    assert loop._drain(adds, {}, []) == ["r0", "r1"]
    assert [len(batch) for batch in calls] == [2]
    got: dict[str, list[int]] = {"r0": [], "r1": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    for rid, prompt in zip(("r0", "r1"), prompts, strict=True):
        assert got[rid] == greedy_of(model, prompt)


def test_an_image_sent_again_is_not_encoded_again(llava, monkeypatch):
    """The encoder cache: the same pixels in a later request (a chat's next turn, a
    beam's request) reuse their features, and the answer is still transformers'; past
    the cache's bytes the least recently used image is encoded again."""
    from engine.sampling_params import SamplingParams
    from server.images import ImageProcessor

    path, model, _ = llava
    engine = Engine(engine_config(str(path)))
    processor = ImageProcessor(str(path), "llava", engine.tokenizer)
    calls = []
    tower = engine.vision._tower
    monkeypatch.setattr(
        engine.vision, "_tower", lambda batch: calls.append(len(batch)) or tower(batch)
    )
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)

    def answer(rid: str, text: str, seed: int) -> list[int]:
        prompt = processor(text, [data_url(png(seed))])  # new ImageInputs every time
        engine.add_request(rid, prompt.token_ids, params, images=prompt.images)
        got = []
        while engine.has_unfinished_requests():
            got += [t for out in engine.step() for t in out.new_token_ids]
        assert got == greedy_of(model, prompt)
        return got

    answer("a", "look <image> here", 5)
    answer("b", "and now <image> again", 5)  # the same image, other text
    assert calls == [1]
    engine.vision.cache.capacity = engine.vision.cache.bytes  # room for one image's rows
    answer("c", "look <image> here", 6)  # another image: the first one's rows go
    answer("d", "look <image> here", 5)
    assert calls == [1, 1, 1]


def test_llm_chat_reads_images_by_file_url_pil_data_and_http_url(
    llava, tmp_path, monkeypatch, image_host
):
    """Offline, as vLLM's LLM.chat: each answer equals transformers'; the images of the
    conversations added together go through the tower in one call."""
    from PIL import Image

    from engine import LLM, SamplingParams

    blobs = [png(seed) for seed in (3, 4, 5, 1)]
    picture = tmp_path / "picture.png"
    picture.write_bytes(blobs[0])
    parts = [
        image_part(f"file://{picture}"),
        {"type": "image_pil", "image_pil": Image.open(io.BytesIO(blobs[1]))},
        image_part(data_url(blobs[2])),
        image_part(f"{image_host}/cat.png"),  # png(1)
    ]
    text = "what is in the picture? "
    conversations = [
        [{"role": "user", "content": [{"type": "text", "text": text}, part]}] for part in parts
    ]
    llm = LLM(str(llava[0]), device="cpu", num_kv_blocks=256)
    calls = []
    tower = llm.engine.vision._tower
    monkeypatch.setattr(
        llm.engine.vision, "_tower", lambda batch: calls.append(batch) or tower(batch)
    )
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = llm.chat(conversations, params, use_tqdm=False)
    for out, blob in zip(outs, blobs, strict=True):
        assert out.outputs[0].token_ids == expected(llava, text, blob)
    assert [len(batch) for batch in calls] == [4]

    # vLLM's generate({"prompt": ..., "multi_modal_data": ...}): the template's text, its
    # placeholder where the image goes.
    prompt = llava[2].apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image"}]}],
        add_generation_prompt=True,
    )
    image = {"image": Image.open(io.BytesIO(blobs[1]))}
    (out,) = llm.generate({"prompt": prompt, "multi_modal_data": image}, params, use_tqdm=False)
    assert out.outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert out.prompt == prompt and out.prompt_token_ids == outs[1].prompt_token_ids
    with pytest.raises(ValueError, match="could not be processed"):
        llm.generate({"prompt": "no placeholder", "multi_modal_data": image}, use_tqdm=False)
    with pytest.raises(ValueError, match="beside a text prompt"):
        llm.generate({"prompt_token_ids": [1, 2], "multi_modal_data": image}, use_tqdm=False)
