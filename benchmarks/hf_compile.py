"""transformers' fastest batch-1 decode: generate with a static KV cache and the forward
under torch.compile(mode="reduce-overhead") (CUDA graphs), timed per token.

    python -m benchmarks.hf_compile --model llama3-8b --input-len 128 --output-len 512

The anchor for Pagoda's batch-1 decode (benchmarks.offline --compare-hf-compile runs it
in the same process, after Pagoda). Random weights at the model's shape, as the
checkpoint says: a checkpoint saved without weights (benchmarks.shapes.ON_DEVICE)
is built from its config on the GPU with transformers' own random initialisation.
Compiling is warm-up: two full generations run before the timed one, so that the timed
one replays graphs only.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.checkpoints import model_dir as checkpoint_dir
from benchmarks.provenance import write_result


class TokenTimes:
    """A generate streamer that notes when each put() arrives: first the prompt, then
    every new token (which generate has moved to the host, so the step is finished)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def per_token_ms(times: list[float]) -> dict:
    """Prefill (prompt to first token) and decode figures from a streamer's times."""
    if len(times) < 3:
        raise ValueError("need the prompt and at least two new tokens")
    gaps = [1e3 * (b - a) for a, b in zip(times[1:], times[2:])]
    return {
        "first_token_ms": 1e3 * (times[1] - times[0]),
        "decode_ms_per_token": 1e3 * (times[-1] - times[1]) / (len(times) - 2),
        "decode_ms_p50": statistics.median(gaps),
        "new_tokens": len(times) - 1,
    }


def load_model(model_dir: str, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.models.loader import RANDOM_WEIGHTS_MARKER

    if (Path(model_dir) / RANDOM_WEIGHTS_MARKER).is_file():
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda()
    return model.eval()


def static_generate_kwargs(input_ids: torch.Tensor, output_len: int) -> dict:
    """generate's arguments: greedy, exactly output_len tokens, a static cache. With a
    static cache generate compiles the decoding forward itself (its CompileConfig:
    mode "reduce-overhead", CUDA graphs), marking each step as torch.compile's graph
    trees need; compiling the forward by hand instead fails once the cache is updated
    in place inside a graph."""
    return dict(
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        pad_token_id=0,
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        cache_implementation="static",
    )


def time_static_compile(
    model_dir: str, dtype: torch.dtype, prompt: list[int], output_len: int, warmup: int = 2
) -> dict:
    """Batch-1 greedy generate of `output_len` tokens, static cache, compiled forward."""
    model = load_model(model_dir, dtype)
    model.generation_config.eos_token_id = None
    input_ids = torch.tensor([prompt], device="cuda")
    kwargs = static_generate_kwargs(input_ids, output_len)
    compile_start = time.perf_counter()
    with torch.inference_mode():
        for _ in range(warmup):  # compiles, then records the graphs, at this cache size
            model.generate(input_ids, **kwargs)
        torch.cuda.synchronize()
        warmup_s = time.perf_counter() - compile_start
        streamer = TokenTimes()
        model.generate(input_ids, streamer=streamer, **kwargs)
    result = per_token_ms(streamer.times) | {"warmup_s": warmup_s, "prompt_len": len(prompt)}
    del model
    torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    import transformers

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="llama3-8b", help="a benchmarks.shapes name or a dir")
    p.add_argument("--input-len", type=int, default=128, help="random prompt tokens")
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    model_dir = checkpoint_dir(args.model, args.dtype)
    rng = random.Random(0)
    prompt = [rng.randrange(10000) for _ in range(args.input_len)]
    result = {
        "benchmark": "hf_compile",
        "command": "python -m benchmarks.hf_compile "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": args.model,
        "dtype": args.dtype,
        "transformers_static_compile": time_static_compile(
            model_dir, dtype, prompt, args.output_len
        ),
    }
    print(json.dumps(result, indent=2))
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
