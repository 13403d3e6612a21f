"""How a `pagoda serve` flag maps to a config field (`adder`), the parsers of flag values
with a syntax of their own, and the engine's flags (server/cli.py adds the server's).

Every flag but --disable-log-stats and --speculative-config sets the EngineConfig or
ServerConfig field named by its `dest`, and defaults to that field's default.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from engine.config import EngineConfig
from server.config import ServerConfig

_ENGINE = EngineConfig()
_SERVER = ServerConfig()
Add = Callable[..., None]


def adder(group: Any) -> Add:
    """add(*flags, help=..., **kw): a flag of `group` whose default is the EngineConfig or
    ServerConfig field `dest` (the first flag's name, less a `no-`), of that default's type
    unless told otherwise; a field that defaults to a bool is a switch that stores the other."""

    def add(*flags: str, help: str | None = None, **kw: Any) -> None:
        name = flags[0].removeprefix("--").removeprefix("no-")
        kw.setdefault("dest", name.replace("-", "_"))
        if "action" not in kw:
            config = _ENGINE if hasattr(_ENGINE, kw["dest"]) else _SERVER
            default = kw.setdefault("default", getattr(config, kw["dest"]))
            if isinstance(default, bool):
                kw["action"] = "store_false" if default else "store_true"
            elif type(default) in (int, float, str):
                kw.setdefault("type", type(default))
        group.add_argument(*flags, help=help, **kw)

    return add


def lora_module(text: str) -> tuple[str, str]:
    """NAME=DIR, or vLLM's JSON object with name and path."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
            return str(spec["name"]), str(spec["path"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise argparse.ArgumentTypeError(f"{text!r}: not a JSON name/path object ({e})") from e
    name, sep, path = text.partition("=")
    if not (sep and name and path):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=DIR")
    return name, path


SPECULATIVE_KEYS = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


def speculative_config(text: str) -> dict[str, int]:
    """vLLM's --speculative-config JSON: the n-gram method and its three numbers."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: not JSON ({e})") from e
    if not isinstance(spec, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a JSON object")
    method = spec.pop("method", "ngram")
    if method not in ("ngram", "[ngram]"):
        raise argparse.ArgumentTypeError(
            f"speculative method {method!r} is not supported: Pagoda speculates by n-gram "
            'lookup only ("method": "ngram")'
        )
    unknown = sorted(set(spec) - set(SPECULATIVE_KEYS))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unsupported --speculative-config keys {unknown} (known: method, "
            f"{', '.join(SPECULATIVE_KEYS)})"
        )
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in spec.values()):
        raise argparse.ArgumentTypeError(f"{text!r}: the values must be integers")
    if "num_speculative_tokens" not in spec:
        raise argparse.ArgumentTypeError(f"{text!r}: num_speculative_tokens is required")
    return spec


def image_limit(text: str) -> int:
    """vLLM's --limit-mm-per-prompt JSON: its "image" count (the one modality served)."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: not JSON ({e})") from e
    if not isinstance(spec, dict) or any(spec[k] != 0 for k in set(spec) - {"image"}):
        raise argparse.ArgumentTypeError(
            f'{text!r}: expected {{"image": N}} (other modalities are not served: 0 only)'
        )
    count = spec.get("image")
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the image count must be an integer >= 0")
    return count


def add_engine_flags(e: Add, t: Add) -> None:
    """The engine's flags (e) and tensor parallelism's (t), through `adder`s."""
    e(
        "--model",
        metavar="DIR",
        help="local Hugging Face checkpoint directory (default: the embedded demo model)",
    )
    e("--device", help="auto | cpu | cuda[:N]")
    e("--dtype", choices=["auto", "float32", "float16", "bfloat16"])
    e(
        "--quantization",
        "-q",
        choices=["fp8"],
        help="fp8: dense projections in FP8 (e4m3, per-channel scales), quantized at load "
        "(CUDA, compute capability 8.9+; FP8 checkpoints use it by themselves)",
    )
    e(
        "--kv-cache-dtype",
        choices=["auto", "fp8"],
        help="fp8: the KV cache in FP8 (e4m3), twice the blocks (CUDA, compute capability 8.9+)",
    )
    e("--block-size", help="tokens per KV-cache block")
    e("--num-kv-blocks", type=int, help="KV-cache blocks (default: sized from free memory)")
    e("--gpu-memory-utilization", help="fraction of GPU memory the engine may use")
    e("--max-num-seqs", help="most requests in one batch")
    e(
        "--max-num-batched-tokens",
        type=int,
        help="most tokens in one step (default: 2048; an encoder's 32768)",
    )
    e("--max-model-len", type=int, help="context length (default: the model's)")
    e(
        "--enable-prefix-caching",
        action="store_const",
        const=True,
        help="reuse cached prompt prefixes (the default, except for models with recurrent "
        "layers, whose states are then saved at block boundaries too)",
    )
    e(
        "--no-prefix-caching",
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_const",
        const=False,
        help="turn the prefix cache off",
    )
    e(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        help="fcfs: requests in arrival order; priority: by each request's `priority` "
        "(lower first), then arrival, to admit and (the last) to preempt",
    )
    e(
        "--pooling-type",
        type=str.upper,
        choices=["LAST", "CLS", "MEAN"],
        help="how embeddings pool the prompt's final states: the last token's, the first's, "
        "or their mean (default: the model's sentence-transformers config, else CLS for an "
        "encoder, LAST for a decoder)",
    )
    e("--enforce-eager", help="no CUDA graphs")
    e(
        "--no-prefill-graphs",
        help="steps with prefill run eagerly (decode-only steps still replay CUDA graphs)",
    )
    e(
        "--cuda-graph-sizes",
        type=int,
        nargs="+",
        metavar="N",
        help="decode batch sizes to capture CUDA graphs for (default: 1 2 4 8 16 24 ... "
        "every 8; --max-num-seqs is always one): fewer capture faster, padding more rows",
    )
    e(
        "--lora-modules",
        nargs="+",
        type=lora_module,
        metavar="NAME=DIR",
        help="LoRA adapters (PEFT directories) to serve beside the model, each as a model "
        'named NAME (also vLLM\'s JSON form: \'{"name": ..., "path": ...}\')',
    )
    e(
        "--max-lora-rank",
        type=int,
        help="pad every adapter to this rank (default: the largest adapter's; with "
        "--enable-lora 16 at least)",
    )
    e(
        "--enable-lora",
        help="adapter slots on every projection, so adapters load while serving "
        "(/v1/load_lora_adapter; --lora-modules alone serves its adapters without)",
    )
    e(
        "--max-loras",
        type=int,
        metavar="N",
        help="with --enable-lora, adapters held at once (default: 1, or as many as "
        "--lora-modules names)",
    )
    e("--no-async-scheduling", help="read each step's sampled ids before planning the next")
    e(
        "--num-speculative-tokens",
        metavar="K",
        help="speculative decoding: up to K draft tokens a step by n-gram lookup in the "
        "request's own tokens, verified in one forward (sampled ids are then read before "
        "the next step is planned)",
    )
    e("--prompt-lookup-min", type=int, metavar="N", help="shortest n-gram matched (default 5)")
    e("--prompt-lookup-max", type=int, metavar="N", help="longest n-gram matched (default 5)")
    e(
        "--speculative-config",
        type=speculative_config,
        action="store",
        default=None,
        metavar="JSON",
        help='vLLM\'s form of the three above: \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 3}\'',
    )
    e("--seed", help="seed for unseeded requests")
    e("--nvtx", help="NVTX ranges around step phases (for nsys)")
    e(
        "--stream-interval",
        metavar="N",
        help="stream every N tokens (the first at once): less host work per token, coarser chunks",
    )
    t(
        "--tensor-parallel-size",
        "-tp",
        metavar="N",
        help="split the model over N ranks (one process and device each)",
    )
    t("--nnodes", help="machines the ranks are spread over")
    t(
        "--node-rank",
        help="this machine's index (0 serves HTTP and schedules; the others run --headless)",
    )
    t("--master-addr", metavar="HOST", help="node 0's address, where every rank meets")
    t(
        "--master-port",
        metavar="P",
        help="node 0's rendezvous port (default: a free one; needed with --nnodes > 1)",
    )
    t("--headless", help="run this node's ranks only, no HTTP (nodes other than 0)")
    t(
        "--disable-custom-all-reduce",
        dest="custom_all_reduce",
        help="sum every tensor with NCCL, also the small ones (a decode step's) that by "
        "default go to torch's symmetric-memory one-shot kernel when all ranks share a node",
    )
    e(
        "--disable-log-stats",
        action="store_true",
        help=f"no engine stats line every {_ENGINE.log_stats_interval:g} s under load",
    )
    e(
        "--log-stats-interval",
        metavar="S",
        help="seconds between engine stats lines (vLLM's VLLM_LOG_STATS_INTERVAL)",
    )
