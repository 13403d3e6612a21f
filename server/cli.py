"""`pagoda serve [flags]` / `python -m server [flags]`, and `pagoda loadtest ...`.

Every flag but --disable-log-stats and --speculative-config sets the EngineConfig or
ServerConfig field named by its `dest`, and defaults to that field's default (vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING=true also sets --allow-runtime-lora-updating).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.heap import pause_collection
from server.config import GENERATION_CONFIG_CHOICES, RUNTIME_LORA_ENV, ServerConfig
from server.reasoning import PARSERS as REASONING_PARSERS
from server.tool_parsers import PARSERS

if TYPE_CHECKING:
    from server.engine_loop import EngineFactory

_ENGINE = EngineConfig()
_SERVER = ServerConfig()


def _adder(group: Any) -> Callable[..., None]:
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


def _lora_module(text: str) -> tuple[str, str]:
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


def _speculative_config(text: str) -> dict[str, int]:
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


def _image_limit(text: str) -> int:
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


def build_parser(prog: str = "pagoda serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="Serve a model over an OpenAI-compatible API."
    )
    e = _adder(p.add_argument_group("engine"))
    t = _adder(p.add_argument_group("tensor parallelism"))
    s = _adder(p.add_argument_group("server"))
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
    e("--no-prefix-caching", dest="enable_prefix_caching", help="turn the prefix cache off")
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
        type=_lora_module,
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
        type=_speculative_config,
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
    s("--host")
    s("--port")
    s(
        "--served-model-name",
        metavar="NAME",
        help="model name in the API (default: the model directory's name)",
    )
    s(
        "--api-key",
        metavar="KEY",
        help="require `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize",
    )
    s(
        "--allowed-origins",
        nargs="+",
        metavar="ORIGIN",
        help="enable CORS for these origins ('*' for any)",
    )
    s("--max-waiting-requests", help="queued requests past which new ones get 503")
    s("--max-request-body-bytes", help="larger request bodies get 413")
    s("--shutdown-timeout", help="seconds in-flight requests get to finish after SIGTERM")
    s(
        "--header-timeout",
        metavar="S",
        help="close a connection whose request headers take longer (slow or idle clients)",
    )
    s(
        "--body-timeout",
        metavar="S",
        help="close a connection whose request body takes longer after its headers",
    )
    s(
        "--timeout-keep-alive",
        metavar="S",
        help="close an idle kept-alive connection after this long (uvicorn's flag)",
    )
    s(
        "--max-connections",
        metavar="N",
        help="past this many open connections, new ones get 503 and are closed",
    )
    s(
        "--engine-process",
        help="run the engine in a process of its own, not a thread (no GIL shared with HTTP)",
    )
    s(
        "--api-server-count",
        metavar="N",
        help="serve HTTP from N processes sharing the port and one engine process "
        "(N > 1 implies --engine-process)",
    )
    s(
        "--enable-auto-tool-choice",
        help='let the model choose to call tools (tool_choice "auto"); needs --tool-call-parser',
    )
    s(
        "--tool-call-parser",
        choices=list(PARSERS),
        help="how tool calls are found in the output: hermes (Qwen2.5/Qwen3, Hermes: "
        "<tool_call> JSON), llama3_json (Llama 3.1+), openai (GPT-OSS's harmony), mistral "
        "([TOOL_CALLS]), glm45 "
        "(GLM-4.5/4.6's <arg_key>/<arg_value> pairs) or qwen3_coder (Qwen3-Coder's "
        "<parameter=...> pairs)",
    )
    s(
        "--generation-config",
        choices=list(GENERATION_CONFIG_CHOICES),
        help="auto: requests that leave temperature, top_p, top_k, min_p or "
        "repetition_penalty out get the model's generation_config.json values, and chat "
        "requests without max_tokens its max_new_tokens (vLLM's default); vllm: OpenAI's "
        "defaults",
    )
    s(
        "--reasoning-parser",
        choices=list(REASONING_PARSERS),
        help="split a reasoning model's <think> ... </think> from its chat answers into "
        "reasoning_content: deepseek_r1 (R1 and its distills), qwen3 or glm45; openai_gptoss "
        "(GPT-OSS's harmony channels) is the default on a GPT-OSS model",
    )
    s(
        "--limit-mm-per-prompt",
        dest="max_images_per_prompt",
        type=_image_limit,
        metavar="JSON",
        help="most images in one request, vLLM's form: '{\"image\": 4}' (default: any)",
    )
    s(
        "--chat-template",
        metavar="FILE|TEMPLATE",
        help="the chat template (a Jinja file, or the template itself) instead of the "
        "tokenizer's, e.g. for a model that has none",
    )
    s(
        "--allow-runtime-lora-updating",
        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (with --enable-lora; "
        f"also set by vLLM's {RUNTIME_LORA_ENV}=true): clients name server directories",
    )
    s(
        "--trust-request-chat-template",
        help="let requests bring their own chat_template (by default a 400): trusted clients only",
    )
    s(
        "--allowed-media-domains",
        nargs="+",
        metavar="HOST",
        help="the only hosts image URLs (and their redirects) may be fetched from "
        "(default: any; name them on a public server)",
    )
    s(
        "--allowed-local-media-path",
        metavar="DIR",
        help="read file:// image URLs under DIR (default: none; trusted clients only)",
    )
    s("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    s(
        "--disable-uvicorn-access-log",
        dest="access_log",
        help="no log line per HTTP request (vLLM's flag of the same name)",
    )
    return p


def parse_configs(
    argv: list[str] | None, prog: str = "pagoda serve"
) -> tuple[EngineConfig, ServerConfig]:
    args = vars(build_parser(prog).parse_args(argv))
    if args.pop("disable_log_stats"):
        args["log_stats_interval"] = 0.0
    if os.environ.get(RUNTIME_LORA_ENV, "").lower() in ("1", "true"):
        args["allow_runtime_lora_updating"] = True
    args.update(args.pop("speculative_config") or {})
    try:
        if args["lora_modules"] is not None:
            names = [name for name, _ in args["lora_modules"]]
            if len(set(names)) < len(names):
                raise ValueError(f"--lora-modules names an adapter twice: {names}")
            args["lora_modules"] = dict(args["lora_modules"])
        engine_config = EngineConfig(
            **{f.name: args[f.name] for f in fields(EngineConfig) if f.init}
        )
        server_config = ServerConfig(**{f.name: args[f.name] for f in fields(ServerConfig)})
        if engine_config.node_rank > 0 and not server_config.headless:
            raise ValueError("--node-rank > 0 runs this node's ranks only: add --headless")
        if server_config.headless and engine_config.node_rank == 0:
            raise ValueError("--headless runs a node other than 0: give its --node-rank")
    except ValueError as exc:
        build_parser(prog).error(str(exc))
    return engine_config, server_config


def serve(
    argv: list[str] | None = None,
    prog: str = "pagoda serve",
    engine_factory: EngineFactory | None = None,
) -> int:
    """Run the server; `engine_factory` (picklable: the engine process may be spawned)
    stands in for the real engine, as benchmarks.api_cost does."""
    # First: --help needs no torch.
    engine_config, server_config = parse_configs(argv, prog)
    logging.basicConfig(
        level=server_config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if server_config.headless:
        from engine.tp_worker import serve_headless

        return serve_headless(engine_config)
    if server_config.api_server_count > 1:
        from server.api_servers import run_api_servers

        return run_api_servers(engine_config, server_config, engine_factory)
    pause_collection()  # until the lifespan freezes the startup heap (engine/heap.py)
    from server.app import create_app
    from server.http_server import serve_app

    app = create_app(engine_config, server_config, engine_factory)
    # SIGINT/SIGTERM: drains connections, then the lifespan stops the engine.
    return 0 if serve_app(app, server_config, None) else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: pagoda {serve,loadtest} [flags]\n\n"
            "  serve     run the OpenAI-compatible server (pagoda serve --help)\n"
            "  loadtest  measure TTFT/ITL/TPOT/E2E against a running server"
        )
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        return serve(rest)
    if command == "loadtest":
        from clients.loadtest import main as loadtest_main  # another package; only when asked

        return loadtest_main(rest)
    print(f"pagoda: unknown command {command!r} (expected serve or loadtest)", file=sys.stderr)
    return 2
