"""A tiny LLaVA with its processor, the images its tests send, and an http host of them:
shared by the server's image tests (test_images.py) and the engine's (test_images_engine.py)
through the fixtures in tests/server/conftest.py."""

from __future__ import annotations

import base64
import contextlib
import copy
import http.server
import io
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.engine.test_multimodal_text import build

TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {% if m.content is string %}{{ m.content }}"
    "{% else %}{% for p in m.content %}{% if p.type == 'image' %}<image>{% else %}"
    "{{ p.text }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}assistant:"
)
MAX_NEW = 8
SLOW = {"arrived": threading.Event(), "release": threading.Event()}


def png(seed: int, size: tuple[int, int] = (40, 52)) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def data_url(blob: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(blob).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": "low"}}


def build_llava(path: Path, tokenizer) -> tuple[Path, Any, Any]:
    """A tiny LLaVA saved at `path` with its processor: (path, transformers' model, the
    processor); the processor's tokenizer is a copy of `tokenizer` with <image> last."""
    import transformers

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})  # the last id
    model = build("llava", path, tokenizer)
    model.generation_config.eos_token_id = None
    crop = {"height": 32, "width": 32}
    images = transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size=crop)
    processor = transformers.LlavaProcessor(
        image_processor=images, tokenizer=tokenizer, patch_size=8, chat_template=TEMPLATE,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
    )  # fmt: skip
    processor.save_pretrained(path)
    return path, model, processor


@contextlib.contextmanager
def serve_images() -> Iterator[str]:
    """An http server of one PNG (/cat.png; /slow.png once SLOW["release"] is set; /to/HOST
    redirects to it on HOST); its base URL."""
    blob = png(1)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the base class's name)
            if self.path.startswith("/to/"):  # a redirect to the host it names
                port = self.server.server_address[1]
                self.send_response(302)
                self.send_header("Location", f"http://{self.path[4:]}:{port}/cat.png")
                self.end_headers()
                return
            if self.path == "/slow.png":  # answered once the test releases it
                SLOW["arrived"].set()
                SLOW["release"].wait(60)
            found = self.path in ("/cat.png", "/slow.png")
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(blob if found else b"")

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()


def expected(llava, text: str, blob: bytes) -> list[int]:
    """transformers' greedy answer to a chat of `text` and the image `blob`, through the
    processor (`llava`: what build_llava returns)."""
    from PIL import Image

    _, model, processor = llava
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image"}]}],
        add_generation_prompt=True,
    )
    image = Image.open(io.BytesIO(blob)).convert("RGB")
    inputs = processor(text=prompt, images=[image], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def greedy_of(model, prompt) -> list[int]:
    """transformers' greedy answer to a prompt the server's ImageProcessor made."""
    ids = torch.tensor([prompt.token_ids])
    with torch.no_grad():
        out = model.generate(
            ids, pixel_values=prompt.images.pixel_values, attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return out[0, ids.shape[1] :].tolist()
