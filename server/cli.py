"""`pagoda serve [flags]` / `python -m server [flags]`, and `pagoda loadtest ...`: the
server's flags (the engine's are in server/flags.py, as is how a flag sets its config
field; vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=true also sets
--allow-runtime-lora-updating).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import fields
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.heap import pause_collection
from server.config import GENERATION_CONFIG_CHOICES, RUNTIME_LORA_ENV, ServerConfig
from server.flags import add_engine_flags, adder, image_limit
from server.parser_names import PARSERS
from server.reasoning import PARSERS as REASONING_PARSERS

if TYPE_CHECKING:
    from server.engine_loop import EngineFactory


def build_parser(prog: str = "pagoda serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="Serve a model over an OpenAI-compatible API."
    )
    e = adder(p.add_argument_group("engine"))
    t = adder(p.add_argument_group("tensor parallelism"))
    s = adder(p.add_argument_group("server"))
    add_engine_flags(e, t)
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
        "(GLM-4.5/4.6's <arg_key>/<arg_value> pairs), qwen3_coder (Qwen3-Coder's "
        "<parameter=...> pairs), minimax_m2 (MiniMax-M2's <invoke> blocks), or the others "
        "docs/server.md lists",
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
        type=image_limit,
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
