"""Chat requests with images (server/images.py) to a tiny LLaVA served with its processor:
the answer equals transformers' generate on the processor's ids and pixel values, for
a data URL and for an http URL of the same image, in the OpenAI SDK's shape; what is
not an image it can read is a 400; a server's limits on images and where they come from."""

from __future__ import annotations

import copy
import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from server.app import create_app
from server.config import ServerConfig
from tests.engine.test_multimodal_text import build
from tests.server.live_server import LiveServer, engine_config
from tests.server.test_beam_search import beam_search_over
from tests.server.tiny_llava import (
    MAX_NEW,
    SLOW,
    data_url,
    expected,
    image_part,
    png,
)


@pytest.fixture(scope="module")
def server(llava) -> Iterator[LiveServer]:
    config = ServerConfig(shutdown_timeout=5.0)
    live = LiveServer(create_app(engine_config(str(llava[0])), config), config).start()
    yield live
    live.stop()


def chat(server: LiveServer, content: list | str, **extra) -> httpx.Response:
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body | extra, timeout=60)


def test_an_image_by_data_url_is_read_as_transformers_reads_it(server, llava):
    text = "what is in the picture? "
    for seed in (1, 2):
        blob = png(seed)
        response = chat(server, [{"type": "text", "text": text}, image_part(data_url(blob))])
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["token_ids"] == expected(llava, text, blob)
        # The processor's placeholders are in the prompt it counts.
        assert response.json()["usage"]["prompt_tokens"] > 16


def test_an_image_by_http_url_equals_the_same_by_data_url(server, image_host):
    text = [{"type": "text", "text": "describe "}]
    by_url = chat(server, [*text, image_part(f"{image_host}/cat.png")])
    by_data = chat(server, [*text, image_part(data_url(png(1)))])
    assert by_url.status_code == 200, by_url.text
    assert by_url.json()["choices"][0]["token_ids"] == by_data.json()["choices"][0]["token_ids"]
    missing = chat(server, [*text, image_part(f"{image_host}/dog.png")])
    assert missing.status_code == 400 and "Could not fetch" in missing.text


def test_a_slow_image_host_holds_up_no_other_request(server, image_host):
    """Image URLs are fetched on the event loop: while one request waits on its image's
    host, another's prompt is rendered and answered."""
    text = [{"type": "text", "text": "describe "}]
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(chat, server, [*text, image_part(f"{image_host}/slow.png")])
        assert SLOW["arrived"].wait(30)
        try:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            quick = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=10)
            assert quick.status_code == 200, quick.text
            assert not slow.done()
        finally:
            SLOW["release"].set()
        by_data = chat(server, [*text, image_part(data_url(png(1)))])
        assert (
            slow.result().json()["choices"][0]["token_ids"]
            == by_data.json()["choices"][0]["token_ids"]
        )


def test_a_text_only_chat_still_works(server):
    response = chat(server, "hello there")
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"][0]["token_ids"]) == MAX_NEW


@pytest.mark.parametrize(
    "part, message",
    [
        (image_part("data:image/png;base64,@@@"), "not valid base64"),
        (image_part("data:image/png," + "x" * 8), "must be base64"),
        (image_part(data_url(b"not an image at all")), "could not be read"),
        (image_part("file:///etc/passwd"), "read only under --allowed-local-media-path"),
        (image_part("ftp://example.com/a.png"), "data URL or an http(s) URL"),
        ({"type": "input_audio", "input_audio": None}, "text and image_url content parts only"),
        ({"type": "image_url"}, "needs its image_url"),
    ],
)
def test_what_is_not_a_readable_image_is_a_400(server, part, message):
    response = chat(server, [{"type": "text", "text": "look "}, part])
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "messages"


def test_beam_search_with_an_image_returns_transformers_best_beams(server, llava):
    """Each beam's request carries the chat's image: the n best beams of vLLM's search
    over transformers' logits given the image (vision tower and all)."""
    from PIL import Image

    _, model, processor = llava
    blob = png(1)
    response = chat(server, [image_part(data_url(blob))], use_beam_search=True, n=2)
    assert response.status_code == 200, response.text
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}]}], add_generation_prompt=True
    )
    image = Image.open(io.BytesIO(blob)).convert("RGB")
    inputs = processor(text=prompt, images=[image], return_tensors="pt", add_special_tokens=False)
    pixels = inputs["pixel_values"]

    def next_logits(ids: list[int]) -> torch.Tensor:
        return model(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0, -1]

    ids = inputs["input_ids"][0].tolist()
    want = beam_search_over(next_logits, ids, 2, MAX_NEW, eos=-1)  # ignore_eos
    choices = response.json()["choices"]
    assert [c["token_ids"] for c in choices] == [tokens for tokens, _, _ in want]
    assert choices[0]["token_ids"] != choices[1]["token_ids"]


def test_images_cross_to_the_engine_process(server, llava):
    config = ServerConfig(shutdown_timeout=5.0, engine_process=True)
    proc = LiveServer(create_app(engine_config(str(llava[0])), config), config).start()
    try:
        content = [{"type": "text", "text": "and this? "}, image_part(data_url(png(3)))]
        across = chat(proc, content)
        assert across.status_code == 200, across.text
        assert (
            across.json()["choices"][0]["token_ids"]
            == chat(server, content).json()["choices"][0]["token_ids"]
        )
    finally:
        proc.stop()


def test_the_responses_api_takes_input_images(server):
    blob, text = png(4), "what now? "
    chat_answer = chat(server, [{"type": "text", "text": text}, image_part(data_url(blob))])
    parts = [
        {"type": "input_text", "text": text},
        {"type": "input_image", "image_url": data_url(blob), "detail": "auto"},
    ]
    body = {"input": [{"role": "user", "content": parts}], "max_output_tokens": MAX_NEW}
    body |= {"temperature": 0.0}
    response = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=60)
    assert response.status_code == 200, response.text
    (message,) = response.json()["output"]
    want = chat_answer.json()["choices"][0]["message"]["content"]
    assert message["content"][0]["text"] == want
    body["input"][0]["content"][1] = {"type": "input_image", "file_id": "file-1"}
    refused = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=60)
    assert refused.status_code == 400 and "file_id is not served" in refused.text


def test_a_servers_limits_on_images_and_where_they_come_from(llava, image_host, tmp_path):
    """--limit-mm-per-prompt, --allowed-media-domains (redirects checked too) and
    --allowed-local-media-path (no way out of it by .. or a symlink)."""
    media = tmp_path / "media"
    media.mkdir()
    (media / "cat.png").write_bytes(png(1))
    (tmp_path / "secret.png").write_bytes(png(2))
    (media / "link.png").symlink_to(tmp_path / "secret.png")
    config = ServerConfig(
        shutdown_timeout=5.0, max_images_per_prompt=1,
        allowed_media_domains=["127.0.0.1"], allowed_local_media_path=str(media),
    )  # fmt: skip
    live = LiveServer(create_app(engine_config(str(llava[0])), config), config).start()
    port = image_host.rsplit(":", 1)[1]
    try:
        one = [{"type": "text", "text": "look "}, image_part(data_url(png(1)))]
        by_data = chat(live, one)
        assert by_data.status_code == 200
        refused = chat(live, [*one, image_part("http://127.0.0.1:9/never-fetched.png")])
        assert refused.status_code == 400 and "at most 1" in refused.text

        def answer(url: str) -> httpx.Response:
            return chat(live, [one[0], image_part(url)])

        same = by_data.json()["choices"][0]["token_ids"]
        for url in (
            f"{image_host}/cat.png",
            f"file://{media}/cat.png",
            f"file://{media}/./cat.png",
        ):
            response = answer(url)
            assert response.status_code == 200, (url, response.text)
            assert response.json()["choices"][0]["token_ids"] == same
        for url, message in [
            (f"http://localhost:{port}/cat.png", "may not be fetched from 'localhost'"),
            (f"{image_host}/to/localhost", "may not be fetched from 'localhost'"),
            (f"file://{media}/../secret.png", "read only under"),
            (f"file://{media}/link.png", "read only under"),
            (f"file://{media}/missing.png", "Could not read"),
        ]:
            response = answer(url)
            assert response.status_code == 400, (url, response.text)
            assert message in response.json()["error"]["message"], url
    finally:
        live.stop()


def test_the_sdk_example_asks_about_an_image(server, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    picture = tmp_path / "picture.png"
    picture.write_bytes(png(7))
    example = Path(__file__).resolve().parents[2] / "clients" / "examples" / "openai_sdk.py"
    argv = [sys.executable, str(example), "--base-url", server.base_url + "/v1"]
    argv += ["--max-tokens", "3", "--image", str(picture)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "chat with an image:" in proc.stdout


QWEN_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {% if m.content is string %}{{ m.content }}"
    "{% else %}{% for p in m.content %}{% if p.type == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p.text }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}assistant:"
)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, tokenizer):
    """A tiny Qwen2.5-VL served with its image processor: (server, transformers' model,
    the image processor, the tokenizer)."""
    import transformers

    tokenizer = copy.deepcopy(tokenizer)  # the wrapper's last four ids, in its order
    marks = ["<|vision_end|>", "<|vision_start|>", "<|video_pad|>", "<|image_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": marks})
    tokenizer.chat_template = QWEN_TEMPLATE
    path = tmp_path_factory.mktemp("qwen-vl-server")
    model = build("qwen2_5_vl", path, tokenizer)
    model.generation_config.eos_token_id = None
    tokenizer.save_pretrained(path)
    images = transformers.Qwen2VLImageProcessor(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16, max_pixels=32 * 32
    )
    images.save_pretrained(path)
    config = ServerConfig(shutdown_timeout=5.0)
    live = LiveServer(create_app(engine_config(str(path)), config), config).start()
    yield live, model, images, tokenizer
    live.stop()


def test_qwen_vl_images_take_their_3d_positions(qwen):
    """The answer equals transformers' generate on the image processor's patches, each
    placeholder repeated once per merged patch, and the tokens' 3-D positions."""
    from PIL import Image

    server, model, images, tokenizer = qwen
    for seed, size in ((1, (40, 52)), (2, (24, 30))):
        blob = png(seed, size)
        response = chat(server, [{"type": "text", "text": "see "}, image_part(data_url(blob))])
        assert response.status_code == 200, response.text
        inputs = images(images=[Image.open(io.BytesIO(blob)).convert("RGB")], return_tensors="pt")
        count = int(inputs["image_grid_thw"].prod()) // 4
        image = model.config.image_token_id
        # The template's newline after a block tag is trimmed, as transformers renders it.
        text = [tokenizer.encode(t, add_special_tokens=False) for t in ("user: see ", "assistant:")]
        ids = torch.tensor([[*text[0], image - 2, *[image] * count, image - 3, *text[1]]])
        with torch.no_grad():
            out = model.generate(
                ids, pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                mm_token_type_ids=(ids == image).int(), attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0,
            )  # fmt: skip
        assert response.json()["prompt_token_ids"] == ids[0].tolist()
        assert response.json()["choices"][0]["token_ids"] == out[0, ids.shape[1] :].tolist()
