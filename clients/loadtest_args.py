"""The load test's flags (`pagoda loadtest --help`) and the checks argparse cannot
express."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from clients.metrics import parse_goodput

DEFAULT_PROMPT = "Hello, my name is"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagoda loadtest",
        description="Load-test an OpenAI-compatible streaming server.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    target = p.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000")
    target.add_argument(
        "--endpoint",
        default="/v1/completions",
        help="/v1/completions or /v1/chat/completions",
    )
    target.add_argument("--model", help="model name (default: first of GET /v1/models)")
    target.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")

    work = p.add_argument_group("workload (one of --prompt, --input-len-range, --dataset)")
    source = work.add_mutually_exclusive_group()
    source.add_argument(
        "--prompt", help=f"fixed prompt for every request (default {DEFAULT_PROMPT!r})"
    )
    source.add_argument(
        "--input-len-range",
        nargs=2,
        type=int,
        metavar=("A", "B"),
        help="random prompts of A..B words (about one token each); sends ignore_eos",
    )
    source.add_argument("--dataset", type=Path, help='JSONL: {"prompt": ..., "max_tokens": opt}')
    work.add_argument(
        "--output-len-range",
        nargs=2,
        type=int,
        metavar=("A", "B"),
        help="with --input-len-range: max_tokens uniform in A..B (default: --max-tokens)",
    )
    work.add_argument(
        "--prompt-token-ids",
        action="store_true",
        help="with --input-len-range: send random token ids, exactly A..B of them (completions only)",
    )
    work.add_argument("--max-tokens", type=int, default=128, help="for --prompt and --dataset")
    work.add_argument("--ignore-eos", action="store_true", help="for --prompt and --dataset")

    arrival = p.add_argument_group("arrivals (one of --request-rate, --burst, --concurrency)")
    mode = arrival.add_mutually_exclusive_group()
    mode.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="open loop: requests/s with gamma (Poisson by default) gaps; inf = all at once",
    )
    mode.add_argument("--burst", action="store_true", help="send every request at once")
    mode.add_argument(
        "--concurrency",
        type=int,
        help="closed loop: C requests in flight, each sent when one finishes",
    )
    arrival.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the gaps at --request-rate: 1 = Poisson, <1 burstier, inf = evenly spaced",
    )

    bounds = p.add_argument_group("bounds")
    bounds.add_argument(
        "--num-requests", type=int, default=100, help="0 = no count bound (needs --duration)"
    )
    bounds.add_argument("--duration", type=float, help="stop sending new requests after S seconds")
    bounds.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="requests sent first, not counted; it also opens the connections a closed "
        "loop holds (makes an open loop's clients) before the clock starts",
    )
    bounds.add_argument("--timeout", type=float, default=600.0, help="per-request limit (s)")
    bounds.add_argument("--seed", type=int, default=0)
    bounds.add_argument(
        "--workers",
        type=int,
        default=1,
        help="client processes sharing the schedule; one saturates near ~200 streaming req/s",
    )

    out = p.add_argument_group("output")
    out.add_argument(
        "--goodput",
        nargs="+",
        metavar="NAME:MS",
        help="SLOs for goodput, e.g. ttft:200 tpot:50 e2el:5000",
    )
    out.add_argument("--result-file", type=Path, help="JSON with config, records and metrics")
    out.add_argument("--plot-dir", type=Path, help="PNG plots (needs matplotlib)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Reject combinations argparse cannot express; exits with status 2 like argparse."""
    if args.output_len_range and not args.input_len_range:
        parser.error("--output-len-range needs --input-len-range")
    if args.prompt_token_ids and not args.input_len_range:
        parser.error("--prompt-token-ids needs --input-len-range")
    if args.prompt_token_ids and args.endpoint.rstrip("/").endswith("chat/completions"):
        parser.error("--prompt-token-ids works with /v1/completions only")
    if not args.base_url.startswith(("http://", "https://")):
        parser.error("--base-url must start with http:// or https://")
    if args.burst:
        args.request_rate = math.inf
    if args.request_rate <= 0 or args.burstiness <= 0:
        parser.error("--request-rate and --burstiness must be > 0")
    if args.concurrency is not None and args.concurrency < 1:
        parser.error("--concurrency must be >= 1")
    if args.workers < 1 or (args.concurrency is not None and args.workers > args.concurrency):
        parser.error("--workers must be >= 1 (and at most --concurrency)")
    if args.num_requests < 0 or args.warmup < 0 or args.max_tokens < 1 or args.timeout <= 0:
        parser.error("--num-requests/--warmup >= 0, --max-tokens >= 1, --timeout > 0")
    if args.num_requests == 0:
        if args.duration is None:
            parser.error("--num-requests 0 needs --duration")
        if args.concurrency is None and math.isinf(args.request_rate):
            parser.error("--num-requests 0 needs --concurrency or a finite --request-rate")
    try:
        args.slos_ms = parse_goodput(args.goodput)
    except ValueError as e:
        parser.error(str(e))


def parse_checked(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(args, parser)
    return args
