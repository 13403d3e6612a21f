"""Requests with images at a real size: Pagoda's engine against transformers' batched
generate, same GPU, same random-weight model, same requests.

The model is Qwen2.5-VL-7B's shape (28 layers of 3584, a 32-block vision tower of 1280
with windowed attention) in bf16, its weights random (speed does not depend on
values). Each request holds one image of `--image` pixels square (patches of 14,
merged 2 x 2: a 448 image is 256 tokens), a few dozen text tokens, and asks for
`--max-tokens` tokens, EOS ignored. Every request's image differs; their prompts have
one length, so transformers' batch needs no padding. Reported: each side's wall time
for the whole batch (vision tower, prefill, decode) and output tokens per second;
Pagoda's mean and largest time to first token, and its adds' time (the images through
the tower, in one call as the server's engine loop makes for a burst).

    python -m benchmarks.images --requests 32 --out benchmarks/results/images-h200.json
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.checkpoints import synthetic_tokenizer
from benchmarks.provenance import provenance, write_result

PATCH, MERGE, TEMPORAL = 14, 2, 2


def qwen2_5_vl_7b(tiny: bool):
    from transformers import Qwen2_5_VLConfig

    text = dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
        rope_scaling={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
    )  # fmt: skip
    vision = dict(
        depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
        patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL,
        window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
    )  # fmt: skip
    if tiny:  # a CPU check of the script itself
        text |= dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
        text |= dict(num_attention_heads=4, num_key_value_heads=2, vocab_size=1024)
        text["rope_scaling"] = dict(text["rope_scaling"], mrope_section=[2, 3, 3])
        vision |= dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2)
        vision |= dict(out_hidden_size=64, fullatt_block_indexes=[1])
    ids = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652)
    if tiny:
        ids = dict(image_token_id=1023, video_token_id=1022, vision_start_token_id=1021)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)


def requests(config, n: int, image: int, text_len: int, seed: int = 0):
    """(prompt ids, [ImageInputs]): one image of image x image pixels per request."""
    from engine.images import ImageInputs

    grid = image // PATCH
    tokens = grid * grid // MERGE**2
    gen = torch.Generator().manual_seed(seed)
    start, pad = config.vision_start_token_id, config.image_token_id
    prompt = list(range(100, 100 + text_len)) + [start] + [pad] * tokens + [start - 1, 7, 8]
    dim = 3 * TEMPORAL * PATCH * PATCH
    thw = torch.tensor([[1, grid, grid]])
    images = [
        ImageInputs(torch.randn(grid * grid, dim, generator=gen), {"image_grid_thw": thw})
        for _ in range(n)
    ]
    return prompt, images


def run_pagoda(path: str, prompt, images, warm, max_tokens: int, device: str) -> dict:
    from engine import SamplingParams
    from engine.config import EngineConfig
    from engine.engine import Engine

    engine = Engine(EngineConfig(model=path, device=device, dtype="bfloat16", max_num_seqs=64))
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False
    )
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def once(tag: str, batch: list) -> tuple[float, list[float], int]:
        sync()
        start = time.perf_counter()
        engine.vision.prefetch(batch)  # as the server's engine loop does for a burst of adds
        for i, image in enumerate(batch):
            engine.add_request(f"{tag}{i}", prompt, params, images=image)
        sync()
        added.append(time.perf_counter() - start)
        first: dict[str, float] = {}
        produced = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                first.setdefault(out.request_id, time.perf_counter())
                produced += len(out.new_token_ids)
        sync()
        wall = time.perf_counter() - start
        return wall, [t - start for t in first.values()], produced

    added: list[float] = []  # the adds' seconds: each encodes its request's images
    # Graphs, kernels' first launches, the tower's first run; other images, so that the
    # timed run finds none of its blocks in the prefix cache.
    once("warm", warm)
    hits = engine.get_stats().prefix_cache_hits
    wall, ttft, produced = once("run", images)
    hits = engine.get_stats().prefix_cache_hits - hits
    return {
        "wall_s": round(wall, 3),
        "output_tokens": produced,
        "output_tok_s": round(produced / wall, 1),
        "ttft_mean_s": round(sum(ttft) / len(ttft), 3),
        "ttft_max_s": round(max(ttft), 3),
        "prefix_cache_hit_tokens": hits,  # none: every image is new
        "add_s": round(added[-1], 3),  # the requests' adds: their images through the tower
    }


def run_transformers(config, prompt, images, max_tokens: int, device: str) -> dict:
    from transformers import Qwen2_5_VLForConditionalGeneration

    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration._from_config(
            config, dtype=torch.bfloat16, attn_implementation="sdpa"
        ).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt] * len(images), device=device)
    pixels = torch.cat([im.pixel_values for im in images]).to(device, torch.bfloat16)
    thw = torch.cat([im.extra["image_grid_thw"] for im in images]).to(device)
    kwargs = dict(
        pixel_values=pixels, image_grid_thw=thw, attention_mask=torch.ones_like(ids),
        mm_token_type_ids=(ids == config.image_token_id).int(), do_sample=False, pad_token_id=0,
    )  # fmt: skip
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, **kwargs)  # warm
        sync()
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kwargs)
        sync()
    wall = time.perf_counter() - start
    produced = (out.shape[1] - ids.shape[1]) * len(images)
    return {
        "wall_s": round(wall, 3),
        "output_tokens": produced,
        "output_tok_s": round(produced / wall, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--image", type=int, default=448, help="pixels, square")
    p.add_argument("--text", type=int, default=48, help="text tokens before the image")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--tiny", action="store_true", help="a tiny model on CPU: checks the script")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    device = "cpu" if args.tiny else "cuda"
    config = qwen2_5_vl_7b(args.tiny)
    prompt, images = requests(config, args.requests, args.image, args.text)
    _, warm = requests(config, args.requests, args.image, args.text, seed=1)
    from engine.models.loader import RANDOM_WEIGHTS_MARKER

    with tempfile.TemporaryDirectory() as path:
        config.dtype = torch.bfloat16
        config.save_pretrained(path)
        (Path(path) / RANDOM_WEIGHTS_MARKER).write_text("weights drawn at load\n")
        synthetic_tokenizer(1024).save_pretrained(path)
        pagoda = run_pagoda(path, prompt, images, warm, args.max_tokens, device)
    gc.collect()  # the engine's memory, before transformers' model
    if device == "cuda":
        torch.cuda.empty_cache()
    hf = run_transformers(config, prompt, images, args.max_tokens, device)
    result = {
        **provenance("images", argv),
        "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "model": "Qwen2.5-VL-7B shape, random bf16 weights" if not args.tiny else "tiny",
        "workload": {
            "requests": args.requests,
            "image_px": args.image,
            "image_tokens": (args.image // PATCH) ** 2 // MERGE**2,
            "prompt_tokens": len(prompt),
            "max_tokens": args.max_tokens,
        },
        "pagoda": pagoda,
        "transformers": hf,
        "speedup": round(hf["wall_s"] / pagoda["wall_s"], 2),
    }
    print(json.dumps(result, indent=2))
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
