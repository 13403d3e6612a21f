"""`pagoda serve [flags]` / `python -m server [flags]`, and `pagoda loadtest ...`.

Engine flags map 1:1 to EngineConfig fields; the rest build a ServerConfig.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.heap import pause_collection
from server.config import TOOL_CALL_PARSERS, ServerConfig

if TYPE_CHECKING:
    from server.engine_loop import EngineFactory

_ENGINE = EngineConfig()
_SERVER = ServerConfig()


def build_parser(prog: str = "pagoda serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="Serve a model over an OpenAI-compatible API."
    )
    e = p.add_argument_group("engine")
    e.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="local Hugging Face checkpoint directory (default: the embedded demo model)",
    )
    e.add_argument("--device", default=_ENGINE.device, help="auto | cpu | cuda[:N]")
    e.add_argument(
        "--dtype", default=_ENGINE.dtype, choices=["auto", "float32", "float16", "bfloat16"]
    )
    e.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=["fp8"],
        help="fp8: dense projections in FP8 (e4m3, per-channel scales), quantized at load "
        "(CUDA, compute capability 8.9+; FP8 checkpoints use it by themselves)",
    )
    e.add_argument(
        "--kv-cache-dtype",
        default=_ENGINE.kv_cache_dtype,
        choices=["auto", "fp8"],
        help="fp8: the KV cache in FP8 (e4m3), twice the blocks (CUDA, compute capability 8.9+)",
    )
    e.add_argument(
        "--block-size", type=int, default=_ENGINE.block_size, help="tokens per KV-cache block"
    )
    e.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV-cache blocks (default: sized from free memory)",
    )
    e.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=_ENGINE.gpu_memory_utilization,
        help="fraction of GPU memory the engine may use",
    )
    e.add_argument(
        "--max-num-seqs", type=int, default=_ENGINE.max_num_seqs, help="most requests in one batch"
    )
    e.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=_ENGINE.max_num_batched_tokens,
        help="most tokens in one step",
    )
    e.add_argument(
        "--max-model-len", type=int, default=None, help="context length (default: the model's)"
    )
    e.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="turn the prefix cache off",
    )
    e.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    e.add_argument(
        "--no-prefill-graphs",
        "--no-piecewise-graphs",  # the name before prefill steps became one graph each
        dest="prefill_graphs",
        action="store_false",
        help="steps with prefill run eagerly (decode-only steps still replay CUDA graphs)",
    )
    e.add_argument(
        "--cuda-graph-sizes",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="decode batch sizes to capture CUDA graphs for (default: 1 2 4 8 16 24 ... "
        "every 8; --max-num-seqs is always one): fewer capture faster, padding more rows",
    )
    e.add_argument(
        "--no-async-scheduling",
        dest="async_scheduling",
        action="store_false",
        help="read each step's sampled ids before planning the next",
    )
    e.add_argument("--seed", type=int, default=_ENGINE.seed, help="seed for unseeded requests")
    e.add_argument("--nvtx", action="store_true", help="NVTX ranges around step phases (for nsys)")
    e.add_argument(
        "--stream-interval",
        type=int,
        default=_ENGINE.stream_interval,
        metavar="N",
        help="stream every N tokens (the first at once): less host work per token, coarser chunks",
    )
    t = p.add_argument_group("tensor parallelism")
    t.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=_ENGINE.tensor_parallel_size,
        metavar="N",
        help="split the model over N ranks (one process and device each)",
    )
    t.add_argument(
        "--nnodes", type=int, default=_ENGINE.nnodes, help="machines the ranks are spread over"
    )
    t.add_argument(
        "--node-rank",
        type=int,
        default=_ENGINE.node_rank,
        help="this machine's index (0 serves HTTP and schedules; the others run --headless)",
    )
    t.add_argument(
        "--master-addr",
        default=_ENGINE.master_addr,
        metavar="HOST",
        help="node 0's address, where every rank meets",
    )
    t.add_argument(
        "--master-port",
        type=int,
        default=_ENGINE.master_port,
        metavar="P",
        help="node 0's rendezvous port (default: a free one; needed with --nnodes > 1)",
    )
    t.add_argument(
        "--headless",
        action="store_true",
        help="run this node's ranks only, no HTTP (nodes other than 0)",
    )
    e.add_argument(
        "--disable-log-stats",
        action="store_true",
        help=f"no engine stats line every {_ENGINE.log_stats_interval:g} s under load",
    )
    e.add_argument(
        "--log-stats-interval",
        type=float,
        default=_ENGINE.log_stats_interval,
        metavar="S",
        help="seconds between engine stats lines (vLLM's VLLM_LOG_STATS_INTERVAL)",
    )
    s = p.add_argument_group("server")
    s.add_argument("--host", default=_SERVER.host)
    s.add_argument("--port", type=int, default=_SERVER.port)
    s.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="model name in the API (default: the model directory's name)",
    )
    s.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize",
    )
    s.add_argument(
        "--allowed-origins",
        nargs="+",
        default=[],
        metavar="ORIGIN",
        help="enable CORS for these origins ('*' for any)",
    )
    s.add_argument(
        "--max-waiting-requests",
        type=int,
        default=_SERVER.max_waiting_requests,
        help="queued requests past which new ones get 503",
    )
    s.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=_SERVER.max_request_body_bytes,
        help="larger request bodies get 413",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=_SERVER.shutdown_timeout,
        help="seconds in-flight requests get to finish after SIGTERM",
    )
    s.add_argument(
        "--header-timeout",
        type=float,
        default=_SERVER.header_timeout,
        metavar="S",
        help="close a connection whose request headers take longer (slow or idle clients)",
    )
    s.add_argument(
        "--body-timeout",
        type=float,
        default=_SERVER.body_timeout,
        metavar="S",
        help="close a connection whose request body takes longer after its headers",
    )
    s.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=_SERVER.timeout_keep_alive,
        metavar="S",
        help="close an idle kept-alive connection after this long (uvicorn's flag)",
    )
    s.add_argument(
        "--max-connections",
        type=int,
        default=_SERVER.max_connections,
        metavar="N",
        help="past this many open connections, new ones get 503 and are closed",
    )
    s.add_argument(
        "--engine-process",
        action="store_true",
        help="run the engine in a process of its own, not a thread (no GIL shared with HTTP)",
    )
    s.add_argument(
        "--api-server-count",
        type=int,
        default=_SERVER.api_server_count,
        metavar="N",
        help="serve HTTP from N processes sharing the port and one engine process "
        "(N > 1 implies --engine-process)",
    )
    s.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model choose to call tools (tool_choice "auto"); needs --tool-call-parser',
    )
    s.add_argument(
        "--tool-call-parser",
        default=None,
        choices=list(TOOL_CALL_PARSERS),
        help="how tool calls are found in the output: hermes (Qwen2.5/Qwen3, Hermes: "
        "<tool_call> JSON) or llama3_json (Llama 3.1+)",
    )
    s.add_argument(
        "--log-level",
        default=_SERVER.log_level,
        choices=["critical", "error", "warning", "info", "debug"],
    )
    s.add_argument(
        "--disable-uvicorn-access-log",
        dest="access_log",
        action="store_false",
        help="no log line per HTTP request (vLLM's flag of the same name)",
    )
    return p


def parse_configs(
    argv: list[str] | None, prog: str = "pagoda serve"
) -> tuple[EngineConfig, ServerConfig]:
    args = build_parser(prog).parse_args(argv)
    try:
        engine_config = EngineConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            enable_prefix_caching=args.enable_prefix_caching,
            enforce_eager=args.enforce_eager,
            prefill_graphs=args.prefill_graphs,
            cuda_graph_sizes=args.cuda_graph_sizes,
            async_scheduling=args.async_scheduling,
            seed=args.seed,
            nvtx=args.nvtx,
            stream_interval=args.stream_interval,
            log_stats_interval=0.0 if args.disable_log_stats else args.log_stats_interval,
            tensor_parallel_size=args.tensor_parallel_size,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
        )
        server_config = ServerConfig(
            host=args.host,
            port=args.port,
            served_model_name=args.served_model_name,
            api_key=args.api_key,
            allowed_origins=args.allowed_origins,
            max_waiting_requests=args.max_waiting_requests,
            max_request_body_bytes=args.max_request_body_bytes,
            shutdown_timeout=args.shutdown_timeout,
            log_level=args.log_level,
            access_log=args.access_log,
            engine_process=args.engine_process,
            api_server_count=args.api_server_count,
            header_timeout=args.header_timeout,
            body_timeout=args.body_timeout,
            timeout_keep_alive=args.timeout_keep_alive,
            max_connections=args.max_connections,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser,
            headless=args.headless,
        )
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
