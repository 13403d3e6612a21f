"""Load test for OpenAI-compatible streaming servers: TTFT, ITL, TPOT, E2E, throughput.

    python -m clients.loadtest --base-url http://127.0.0.1:8000 \\
        --input-len-range 64 256 --output-len-range 64 128 \\
        --request-rate 8 --num-requests 200 --result-file out.json --plot-dir plots/

The same entry point backs `pagoda loadtest`: `build_parser()` and `main(argv)`.
Metric definitions follow vLLM's benchmark_serving; see clients/metrics.py and
docs/loadtest.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from queue import Empty

import httpx
from tqdm import tqdm

from clients.arrivals import Send, arrival_gaps, closed_loop, open_loop
from clients.connections import Connections
from clients.metrics import (
    BenchmarkMetrics,
    RequestRecord,
    compute_metrics,
    last_end,
    parse_goodput,
)
from clients.report import format_table, write_plots
from clients.stream import request_body, stream_request
from clients.workload import DatasetWorkload, FixedWorkload, RandomWorkload, Workload

DEFAULT_PROMPT = "Hello, my name is"
OPEN_LOOP_RESERVE = 512  # clients made before an open loop's clock, per client process
CLIENT_BUSY = 0.9  # a client process on the CPU more than this share of a run is a suspect


class LoadTestError(Exception):
    """The load test could not run at all (e.g. the server is unreachable)."""


@dataclass
class LoadTestResult:
    model: str
    started_at: str  # wall-clock ISO time of the benchmark start
    t0: float  # perf_counter() at the benchmark start; record times are relative to it
    records: list[RequestRecord]
    warmup_records: list[RequestRecord]
    metrics: BenchmarkMetrics
    notes: list[str]
    # CPU time / run time of each client process over the measured requests: near 1
    # means the client, not the server, may have set the pace.
    client_busy: list[float] = field(default_factory=list)


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


def make_workload(args: argparse.Namespace) -> Workload:
    if args.input_len_range:
        output_range = args.output_len_range or [args.max_tokens, args.max_tokens]
        return RandomWorkload(
            tuple(args.input_len_range), tuple(output_range), args.seed, args.prompt_token_ids
        )
    if args.dataset:
        return DatasetWorkload(args.dataset, args.max_tokens, args.ignore_eos)
    return FixedWorkload(args.prompt or DEFAULT_PROMPT, args.max_tokens, args.ignore_eos)


async def first_model(client: httpx.AsyncClient) -> str:
    try:
        response = await client.get("/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise LoadTestError(f"cannot get a model from GET /v1/models ({e!r}); pass --model") from e


def schedule_lag(args: argparse.Namespace, records: list[RequestRecord], t0: float) -> float:
    """How far behind the open-loop arrival schedule the client actually sent (s).

    The schedule is recomputed from the seed; a lagging client (CPU-bound on
    parsing many streams) offers less load than asked, which the results should say.
    """
    if args.concurrency is not None:
        return 0.0
    gaps = arrival_gaps(args.request_rate, args.burstiness, args.seed)
    lag, scheduled = 0.0, 0.0
    for record in sorted(records, key=lambda r: r.index):
        lag = max(lag, record.send_time - t0 - scheduled)
        scheduled += next(gaps)
    return lag


def result_notes(
    args: argparse.Namespace,
    records: list[RequestRecord],
    t0: float,
    warmup: Sequence[RequestRecord] = (),
    client_busy: Sequence[float] = (),
) -> list[str]:
    notes = []
    warmup_failed = [r for r in warmup if not r.ok]
    if warmup_failed:
        notes.append(
            f"{len(warmup_failed)}/{len(warmup)} warmup requests failed, "
            f"e.g. {warmup_failed[0].error}"
        )
    lag = schedule_lag(args, records, t0)
    if lag > 0.01:
        notes.append(
            f"requests left the client up to {1000 * lag:.0f} ms behind the arrival schedule "
            "(client busy?): the offered load was below --request-rate"
        )
    if client_busy and max(client_busy) > CLIENT_BUSY:
        notes.append(
            f"a client process was on the CPU {100 * max(client_busy):.0f}% of the run: "
            "the server may have been measured at the client's pace (raise --workers)"
        )
    done = [r for r in records if r.ok]
    missing = sum(not r.usage_reported for r in done)
    if missing:
        notes.append(
            f"{missing}/{len(done)} completed requests had no usage chunk: their output tokens "
            "are counted as content chunks and their prompt tokens as 0"
        )
    if args.input_len_range or args.ignore_eos:
        short = sum(r.output_tokens < (r.requested_max_tokens or 0) for r in done)
        if short:
            notes.append(f"{short} requests sent ignore_eos but got fewer tokens than max_tokens")
    return notes


def _sender(
    connections: Connections,
    args: argparse.Namespace,
    model: str,
    workload: Workload,
    on_done: Callable[[], None],
) -> Send:
    chat = args.endpoint.rstrip("/").endswith("chat/completions")

    async def send(index: int) -> RequestRecord:
        spec = workload.request(index)
        record = RequestRecord(index=index, requested_max_tokens=spec.max_tokens)
        body = request_body(spec, model, chat)
        client = connections.take()
        try:
            await asyncio.wait_for(
                stream_request(client, args.endpoint, body, record, chat), args.timeout
            )
        except asyncio.TimeoutError:
            record.fail("timeout", f"no complete response within --timeout {args.timeout:g} s")
        finally:
            connections.give(client)
        if index >= 0:
            on_done()
        return record

    return send


def _width(concurrency: int, share: tuple[int, int]) -> int:
    """A client process's share of a closed loop's concurrency."""
    worker, workers = share
    return concurrency // workers + (worker < concurrency % workers)


async def _prepare(
    connections: Connections, args: argparse.Namespace, share: tuple[int, int]
) -> None:
    """The warmup's part in connections: a closed loop's are opened; for an open loop,
    clients are made for up to OPEN_LOOP_RESERVE of this process's requests."""
    if args.concurrency is not None:
        await connections.open(_width(args.concurrency, share))
    else:
        mine = -(-args.num_requests // share[1]) if args.num_requests else OPEN_LOOP_RESERVE
        connections.reserve(min(mine, OPEN_LOOP_RESERVE))


async def _measured(
    args: argparse.Namespace, send: Send, start: float, share: tuple[int, int] = (0, 1)
) -> list[RequestRecord]:
    """The measured requests of this client process (share: which of how many)."""
    if args.concurrency is not None:
        width = _width(args.concurrency, share)
        return await closed_loop(send, width, args.num_requests, args.duration, start, share)
    gaps = arrival_gaps(args.request_rate, args.burstiness, args.seed)
    return await open_loop(send, gaps, args.num_requests, args.duration, start, share)


async def run_loadtest(args: argparse.Namespace) -> LoadTestResult:
    """Run warmup then the measured requests; `args` as parsed and checked by main()."""
    workload = make_workload(args)
    async with Connections(args) as connections:
        client = connections.take()
        model = args.model or await first_model(client)
        connections.give(client)
        total = args.num_requests or None
        bar = tqdm(total=total, unit="req", disable=args.no_progress, file=sys.stderr)
        send = _sender(connections, args, model, workload, bar.update)

        warmup: list[RequestRecord] = []
        if args.warmup:
            # Negative indices: warmup prompts differ from the measured ones.
            width = min(args.warmup, args.concurrency or args.warmup)
            warmup = await closed_loop(lambda i: send(-1 - i), width, args.warmup, None)
            if args.workers == 1:
                await _prepare(connections, args, (0, 1))

        started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        try:
            if args.workers > 1:
                t0, records, cpu = await asyncio.to_thread(_run_workers, args, model, bar)
            else:
                t0, cpu0 = time.perf_counter(), time.process_time()
                records = await _measured(args, send, t0)
                cpu = [time.process_time() - cpu0]
        finally:
            bar.close()
        # vLLM's duration: from the start to the last request's end, not to when
        # this process has the records (from client processes, that takes a while).
        end = last_end(records)
        duration = (time.perf_counter() if end is None else end) - t0

    metrics = compute_metrics(records, duration, args.slos_ms)
    busy = [c / duration for c in cpu] if duration > 0 else []
    return LoadTestResult(
        model=model,
        started_at=started_at,
        t0=t0,
        records=records,
        warmup_records=warmup,
        metrics=metrics,
        notes=result_notes(args, records, t0, warmup, busy),
        client_busy=busy,
    )


# ---------------------------------------------------------------- client processes
# One Python process saturates its core near a couple of hundred streaming
# requests a second (HTTP, SSE parsing, JSON): past that a fast server would be
# measured at the client's speed. --workers N splits the one arrival schedule
# across N spawned processes, each with its own event loop and connections, all
# timed on the machine's one monotonic clock (perf_counter).


def _run_workers(
    args: argparse.Namespace, model: str, bar: tqdm
) -> tuple[float, list[RequestRecord], list[float]]:
    ctx = multiprocessing.get_context("spawn")
    n = args.workers
    ready, ticks, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    go, start = ctx.Event(), ctx.Value("d", 0.0)
    procs = [
        ctx.Process(
            target=_worker_main,
            args=(args, model, (w, n), ready, go, start, ticks, results),
            name=f"loadtest-{w}",
            daemon=True,
        )
        for w in range(n)
    ]
    for proc in procs:
        proc.start()
    try:
        for _ in range(n):  # every process has its client before the clock starts
            _get(ready, procs, set(), "a client process died while starting")
        start.value = time.perf_counter() + 0.01
        go.set()
        records: list[RequestRecord] = []
        cpu = [0.0] * n
        done: set[int] = set()
        for _ in range(n):
            worker, part, cpu[worker] = _get(
                results, procs, done, "a client process died", ticks, bar
            )
            done.add(worker)
            records += part
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
    return start.value, sorted(records, key=lambda r: r.index), cpu


def _get(queue, procs, done: set[int], died: str, ticks=None, bar: tqdm | None = None):
    """Next item of queue, moving progress ticks along; raise if a worker failed, or
    exited without delivering (done: the workers that have delivered)."""
    while True:
        while ticks is not None and not ticks.empty():
            bar.update(ticks.get())
        try:
            item = queue.get(timeout=0.1)
        except Empty:
            gone = [w for w, proc in enumerate(procs) if not proc.is_alive() and w not in done]
            if gone and queue.empty():
                raise LoadTestError(died) from None
            continue
        if isinstance(item, str):
            raise LoadTestError(f"client process failed: {item}")
        return item


def _worker_main(args, model, share, ready, go, start, ticks, results) -> None:
    try:
        records, cpu = asyncio.run(_worker_run(args, model, share, ready, go, start, ticks))
        results.put((share[0], records, cpu))
    except BaseException as exc:  # the parent turns it into a LoadTestError
        ready.put(f"{type(exc).__name__}: {exc}")
        results.put(f"{type(exc).__name__}: {exc}")


async def _worker_run(
    args, model, share, ready, go, start, ticks
) -> tuple[list[RequestRecord], float]:
    """This process's records and the CPU time it spent on them."""
    async with Connections(args) as connections:
        send = _sender(connections, args, model, make_workload(args), lambda: ticks.put(1))
        if args.warmup:
            await _prepare(connections, args, share)
        ready.put(share[0])
        await asyncio.to_thread(go.wait)
        cpu0 = time.process_time()
        records = await _measured(args, send, start.value, share)
        return records, time.process_time() - cpu0


def result_json(args: argparse.Namespace, result: LoadTestResult, argv: list[str]) -> dict:
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config.pop("api_key", None)  # never write secrets into result files
    return {
        "argv": argv,
        "config": config,
        "model": result.model,
        "started_at": result.started_at,
        "metrics": result.metrics.to_json(),
        "notes": result.notes,
        "client_busy": result.client_busy,
        "records": [r.to_json(result.t0) for r in result.records],
        "warmup_records": [r.to_json(result.t0) for r in result.warmup_records],
    }


def _json_safe(value: float) -> float | str:
    # JSON has no Infinity; "inf" keeps the file readable by strict parsers.
    return "inf" if isinstance(value, float) and math.isinf(value) else value


def write_result(path: Path, data: dict) -> None:
    data["config"] = {k: _json_safe(v) for k, v in data["config"].items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def parse_checked(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(args, parser)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_checked(argv)
    try:
        result = asyncio.run(run_loadtest(args))
    except (LoadTestError, ValueError, OSError) as e:
        print(f"loadtest: {e}", file=sys.stderr)
        return 1

    print(format_table(result.metrics, result.notes))
    if args.result_file:
        write_result(args.result_file, result_json(args, result, argv))
        print(f"results: {args.result_file}")
    if args.plot_dir:
        paths = write_plots(result.records, result.t0, args.plot_dir)
        if paths is None:
            print("plots skipped: matplotlib is not installed (pip install matplotlib)")
        else:
            print("plots: " + ", ".join(str(p) for p in paths))
    # A run where nothing succeeded measured nothing; say so in the exit status.
    return 0 if result.metrics.completed else 1


if __name__ == "__main__":
    sys.exit(main())
