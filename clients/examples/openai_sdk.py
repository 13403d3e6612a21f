"""Pagoda through the official openai SDK: completions and chat, streamed and not;
with --image, a chat about an image (a model that reads images: LLaVA, Gemma 3, ...).

    python -m server &                         # demo model on 127.0.0.1:8000
    python clients/examples/openai_sdk.py
    python clients/examples/openai_sdk.py --image photo.png   # or an http(s) URL

Any OpenAI-compatible server works; only base_url changes.
"""

import argparse
import base64
import mimetypes

from openai import OpenAI


def image_url(path_or_url: str) -> str:
    """An http(s) URL as it is; a local file as a base64 data URL."""
    if path_or_url.startswith(("http://", "https://", "data:")):
        return path_or_url
    kind = mimetypes.guess_type(path_or_url)[0] or "image/png"
    with open(path_or_url, "rb") as f:
        return f"data:{kind};base64,{base64.b64encode(f.read()).decode()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="EMPTY", help="the server's --api-key, if it has one")
    parser.add_argument("--model", help="default: the first model the server lists")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--image", help="a local image file or an http(s) URL to ask about")
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = args.model or client.models.list().data[0].id

    completion = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=args.max_tokens
    )
    print("completion:", completion.choices[0].text)

    print("completion, streamed:", end="", flush=True)
    for chunk in client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=args.max_tokens, stream=True
    ):
        if chunk.choices:
            print(chunk.choices[0].text, end="", flush=True)
    print()

    messages = [{"role": "user", "content": "Say hello in three languages."}]
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=args.max_tokens
    )
    print("chat:", chat.choices[0].message.content)

    print("chat, streamed:", end="", flush=True)
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=args.max_tokens,
        stream=True,
        # The last chunk then carries token counts, as the load test uses them.
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage:
            print(
                f"\n[usage: {chunk.usage.prompt_tokens} prompt + "
                f"{chunk.usage.completion_tokens} completion tokens]",
                end="",
            )
    print()

    if args.image:
        content = [
            {"type": "text", "text": "What is in this image?"},
            {"type": "image_url", "image_url": {"url": image_url(args.image)}},
        ]
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}], max_tokens=args.max_tokens
        )
        print("chat with an image:", chat.choices[0].message.content)


if __name__ == "__main__":
    main()
