"""Chat images: image_url content parts into the prompt's ids and pixel values.

For a model whose images Pagoda reads (engine/models/vision.py), a message with
image parts reaches the chat template as a list of parts, `{"type": "image"}` where
each image was, as the models' own templates expect; the checkpoint's processor then
expands each image's placeholder into one token per feature and makes its pixel
values. Images come as data URLs (base64), http(s) URLs fetched on the event loop (to
any host, or those of --allowed-media-domains), or file:// URLs under
--allowed-local-media-path. Anything that is not an image it can open is a 400.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import copy
import hashlib
import io
import threading
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from engine.images import MROPE_FAMILIES, ImageInputs
from server.errors import APIError

if TYPE_CHECKING:
    from PIL.Image import Image
    from transformers import PreTrainedTokenizerBase

    from server.protocol import ChatMessage


@dataclass
class ChatPrompt:
    """A chat's prompt: its ids, and its images where it has any."""

    token_ids: list[int]
    images: ImageInputs | None = None


MAX_IMAGE_BYTES = 20 << 20  # OpenAI's limit per image
FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class MediaAccess:
    """Where an image URL may point beyond data URLs (vLLM's flags of the same names)."""

    # --allowed-media-domains: the hosts http(s) URLs and their redirects may name; None: any
    allowed_media_domains: frozenset[str] | None = None
    # --allowed-local-media-path: file:// URLs are read under this directory; None: never
    allowed_local_media_path: Path | None = None

    @classmethod
    def of(cls, domains: list[str] | None, local_dir: str | None) -> MediaAccess:
        return cls(
            None if domains is None else frozenset(d.lower() for d in domains),
            None if local_dir is None else Path(local_dir),
        )

    def check_host(self, request: httpx.Request) -> None:
        """Before the first request of a fetch and each redirect's."""
        domains = self.allowed_media_domains
        if domains is not None and request.url.host.lower() not in domains:
            raise APIError(
                f"Images may not be fetched from {request.url.host!r} (--allowed-media-domains).",
                param="messages",
            )

    def local_file(self, url: str) -> bytes:
        if self.allowed_local_media_path is None:
            raise APIError(
                "An image_url must be a data URL or an http(s) URL (file:// URLs are read "
                "only under --allowed-local-media-path).",
                param="messages",
            )
        root = self.allowed_local_media_path.resolve()
        parts = urllib.parse.urlsplit(url)
        path = Path(urllib.parse.unquote(parts.path)).resolve()  # symlinks and .. resolved
        if parts.netloc not in ("", "localhost") or not path.is_relative_to(root):
            raise APIError(
                f"Images are read only under {root} (--allowed-local-media-path).",
                param="messages",
            )
        try:
            with path.open("rb") as f:
                return f.read(MAX_IMAGE_BYTES + 1)
        except OSError as exc:
            raise APIError(f"Could not read the image at {url}: {exc}", param="messages") from exc


def image_urls(messages: list[ChatMessage]) -> list[str]:
    """The URLs of the messages' image_url parts, in order."""
    return [
        part.image_url.url
        for message in messages
        if isinstance(message.content, list)
        for part in message.content
        if part.type == "image_url" and part.image_url is not None
    ]


def web_urls(urls: list[str]) -> list[str]:
    """The http(s) URLs among urls, each once."""
    return sorted({url for url in urls if url.startswith(("http://", "https://"))})


async def fetch_images(urls: list[str], access: MediaAccess) -> dict[str, bytes]:
    """The bodies of the http(s) URLs among urls, fetched together on the event loop, so
    a slow host holds no prompt lane; the other URLs are read by image_bytes."""
    wanted = web_urls(urls)
    if not wanted:
        return {}

    async def check_host(request: httpx.Request) -> None:  # before each request and redirect
        access.check_host(request)

    async with httpx.AsyncClient(
        timeout=FETCH_TIMEOUT_S, follow_redirects=True, event_hooks={"request": [check_host]}
    ) as client:
        bodies = await asyncio.gather(*(_fetch(client, url) for url in wanted))
    return dict(zip(wanted, bodies))


async def _fetch(client: httpx.AsyncClient, url: str) -> bytes:
    try:
        async with client.stream("GET", url) as r:
            r.raise_for_status()
            body = bytearray()
            async for chunk in r.aiter_bytes():
                body += chunk
                if len(body) > MAX_IMAGE_BYTES:  # image_bytes refuses it
                    break
            return bytes(body)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise APIError(f"Could not fetch the image at {url}: {exc}", param="messages") from exc


def fetch_images_now(urls: list[str], access: MediaAccess) -> dict[str, bytes]:
    """fetch_images from synchronous code (LLM.chat), on an event loop of its own thread:
    a caller inside a running loop (a notebook) is served too."""
    if not web_urls(urls):
        return {}
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, fetch_images(urls, access)).result()


def image_bytes(url: str, access: MediaAccess, fetched: dict[str, bytes]) -> bytes:
    """An image_url's bytes: a data URL's, a file:// URL's file, or an http(s) URL's body
    from fetched (fetch_images')."""
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise APIError("An image data URL must be base64 (data:image/...;base64,...).",
                           param="messages")  # fmt: skip
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise APIError(
                f"An image data URL is not valid base64: {exc}", param="messages"
            ) from exc
    elif url.startswith(("http://", "https://")):
        data = fetched[url]
    elif url.startswith("file:"):
        data = access.local_file(url)
    else:
        raise APIError("An image_url must be a data URL or an http(s) URL.", param="messages")
    if len(data) > MAX_IMAGE_BYTES:
        raise APIError(f"An image is larger than {MAX_IMAGE_BYTES >> 20} MiB.", param="messages")
    return data


def png_bytes(image: Image) -> bytes:
    """A PIL image as a PNG file's bytes (LLM's PIL images take the URLs' path)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def open_image(data: bytes) -> Image:
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise APIError(f"An image could not be read: {exc}", param="messages") from exc
    return image.convert("RGB")


class QwenVLProcessor:
    """transformers' Qwen2-VL processor for images alone: the checkpoint's image
    processor, then each image placeholder repeated once per feature (its patch grid
    over merge_size squared). Theirs also loads a video processor, which needs
    torchvision."""

    def __init__(self, model_dir: str, tokenizer: PreTrainedTokenizerBase) -> None:
        from transformers import AutoImageProcessor

        self.images = AutoImageProcessor.from_pretrained(model_dir, local_files_only=True)
        self.tokenizer = tokenizer
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"

    def __call__(self, text: str, images: list, **kwargs) -> dict:
        import torch

        out = dict(self.images(images=images, return_tensors="pt"))
        counts = (out["image_grid_thw"].prod(-1) // self.images.merge_size**2).tolist()
        pieces = text.split(self.image_token)
        if len(pieces) != len(counts) + 1:
            raise ValueError(f"{len(pieces) - 1} image placeholders for {len(counts)} images")
        text = pieces[0] + "".join(
            self.image_token * n + piece for n, piece in zip(counts, pieces[1:])
        )
        special = kwargs.get("add_special_tokens", False)
        ids = self.tokenizer.encode(text, add_special_tokens=special)
        return {"input_ids": torch.tensor([ids]), **out}


class ImageProcessor:
    """The checkpoint's processor (AutoProcessor), a copy per prompt lane thread."""

    def __init__(
        self,
        model_dir: str,
        model_type: str,
        tokenizer: PreTrainedTokenizerBase,
        max_images: int | None = None,  # per request (--limit-mm-per-prompt); None: any
        access: MediaAccess = MediaAccess(),
    ) -> None:
        from transformers import AutoProcessor

        self.max_images = max_images
        self.access = access
        if model_type in MROPE_FAMILIES:
            self.processor = QwenVLProcessor(model_dir, tokenizer)
        else:
            self.processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
        self._local = threading.local()

    def check_count(self, urls: list[str]) -> None:
        if self.max_images is not None and len(urls) > self.max_images:
            raise APIError(
                f"The request has {len(urls)} images; at most {self.max_images} are allowed "
                "(--limit-mm-per-prompt).",
                param="messages",
            )

    def __call__(
        self, text: str, urls: list[str], fetched: dict[str, bytes] | None = None
    ) -> ChatPrompt:
        """The prompt's ids, each image's placeholder expanded, and its images; fetched:
        the http(s) URLs' bodies where fetch_images has them already (else fetched now)."""
        self.check_count(urls)
        if fetched is None:
            fetched = fetch_images_now(urls, self.access)
        return self.process(text, [image_bytes(url, self.access, fetched) for url in urls])

    def process(
        self, text: str, blobs: list[bytes], add_special_tokens: bool = False
    ) -> ChatPrompt:
        """text, with a placeholder where each image goes, and the images' file bytes: the
        ids with each placeholder expanded, and the pixel values."""
        digest = hashlib.sha256()
        for blob in blobs:
            digest.update(hashlib.sha256(blob).digest())
        images = [open_image(blob) for blob in blobs]
        processor = getattr(self._local, "processor", None)
        if processor is None:  # its tokenizer may not be shared between threads
            processor = self._local.processor = copy.deepcopy(self.processor)
        try:
            out = processor(
                text=text, images=images, return_tensors="pt", add_special_tokens=add_special_tokens
            )
        except ValueError as exc:  # e.g. placeholders and images that do not pair up
            raise APIError(f"The images could not be processed: {exc}", param="messages") from exc
        extra = {name: out[name] for name in ("image_sizes", "image_grid_thw") if name in out}
        pixels = ImageInputs(out["pixel_values"], extra, digest.hexdigest())
        return ChatPrompt(out["input_ids"][0].tolist(), pixels)
