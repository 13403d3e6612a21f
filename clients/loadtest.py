"""Load test for OpenAI-compatible streaming servers: TTFT, ITL, TPOT, E2E, throughput.

    python -m clients.loadtest --base-url http://127.0.0.1:8000 \\
        --input-len-range 64 256 --output-len-range 64 128 \\
        --request-rate 8 --num-requests 200 --result-file out.json --plot-dir plots/

The same entry point backs `pagoda loadtest`: `main(argv)`, with its flags in
clients/loadtest_args.py.
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
from clients.loadtest_args import DEFAULT_PROMPT, parse_checked
from clients.metrics import (
    BenchmarkMetrics,
    RequestRecord,
    compute_metrics,
    last_end,
)
from clients.report import format_table, write_plots
from clients.stream import request_body, stream_request
from clients.workload import DatasetWorkload, FixedWorkload, RandomWorkload, Workload

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
