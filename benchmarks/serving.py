"""Online serving benchmark: start Pagoda, sweep request rates, run the seeds' workload.

    python -m benchmarks.serving --model /models/gpt2 --out-dir benchmarks/results/serving-h100

1. Offline engine throughput, the ceiling the server is compared with:
   `--offline-tok-s`, else `python -m benchmarks.offline` (run before the server
   starts so the two never share the GPU), else none.
2. The server as a subprocess (`python -m server ...`), until GET /health answers.
   `--base-url` benchmarks an already running server instead (Pagoda or any
   OpenAI-compatible one) and starts nothing.
3. A sweep of Poisson request rates, stopping once output throughput stops
   growing, then `inf` (everything at once), then closed loops at each
   `--concurrency` (a new request as soon as one finishes): throughput vs the
   offline figure, TTFT/ITL/TPOT percentiles per run. `inf` pays for the burst
   (thousands of connections opened at once, an idle GPU meanwhile) within a
   run of a few seconds; a closed loop holds the server at saturation from the
   first request to the last, which is what the offline figure measures.
4. The seeds' streaming workload (64 requests 20 ms apart, prompt "Hello", 128
   tokens each, ignore_eos; published on GPT-2) beside the published figures.

Writes summary.json (GPU, date, git commit, exact command, every figure), each
load test's own JSON and PNGs, a sweep plot, and server.log to --out-dir. A
server it starts logs its engine stats line every second (`--log-stats-interval
1`, before --server-args so they can override it); each sweep row then says
how busy the engine's host side was during that run (`engine`), which tells a
server-bound row from one the GPU or the client paced.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from benchmarks.provenance import git_commit
from benchmarks.serving_report import (
    STATS_INTERVAL_S,
    engine_window,
    fmt,
    plot_sweep,
    print_sweep,
    summarize,
)
from clients import loadtest

# The seeds' published figures for their streaming workload on GPT-2.
SEEDS_OUTPUT_TOK_S = 3211.0
SEEDS_TPOT_P50_MS = 11.8
SEEDS_ARGS = [
    "--prompt", "Hello", "--max-tokens", "128", "--ignore-eos", "--num-requests", "64",
    "--request-rate", "50", "--burstiness", "inf",  # evenly spaced: one every 20 ms
]  # fmt: skip
SATURATION_GAIN = 1.05  # a rate step that adds < 5% output throughput means saturated


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Online serving benchmark for Pagoda.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    server = p.add_argument_group("server")
    server.add_argument("--model", help="HF checkpoint dir (default: the embedded demo model)")
    server.add_argument("--port", type=int, help="default: a free port")
    server.add_argument("--enforce-eager", action="store_true")
    server.add_argument(
        "--server-args", default="", help='more server flags, e.g. "--dtype float16"'
    )
    server.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for /health")
    server.add_argument("--base-url", help="benchmark this running server instead of starting one")
    offline = p.add_argument_group("offline ceiling")
    offline.add_argument("--offline-tok-s", type=float, help="skip benchmarks.offline, use this")
    offline.add_argument("--offline-args", default="", help="extra flags for benchmarks.offline")
    offline.add_argument("--offline-timeout", type=float, default=600.0)
    sweep = p.add_argument_group("rate sweep")
    sweep.add_argument("--rates", type=float, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    sweep.add_argument("--input-len", type=int, default=128)
    sweep.add_argument("--output-len", type=int, default=128)
    sweep.add_argument("--seconds-per-rate", type=float, default=30.0, help="requests = rate * S")
    sweep.add_argument("--min-requests", type=int, default=32)
    sweep.add_argument("--max-requests", type=int, default=600, help="also the inf run's count")
    sweep.add_argument(
        "--concurrency",
        type=int,
        nargs="*",
        default=[],
        help="closed-loop runs at these in-flight counts",
    )
    sweep.add_argument(
        "--concurrency-requests",
        type=int,
        help="requests per closed-loop run (default: --max-requests); a run of a few"
        " seconds is mostly its ramp up and drain, so match the offline run's count",
    )
    sweep.add_argument("--request-timeout", type=float, default=300.0)
    sweep.add_argument("--seed", type=int, default=0)
    sweep.add_argument(
        "--client-workers",
        type=int,
        default=4,
        help="load-test client processes (one saturates near ~200 streaming req/s)",
    )
    p.add_argument("--skip-sweep", action="store_true")
    p.add_argument("--skip-seeds", action="store_true")
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/serving"))
    return p


# ---------------------------------------------------------------- environment


def gpu_name() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- offline figure


def offline_throughput(args: argparse.Namespace, out_dir: Path) -> dict:
    if args.offline_tok_s is not None:
        return {"tok_s": args.offline_tok_s, "source": "--offline-tok-s"}
    if importlib.util.find_spec("benchmarks.offline") is None:
        return {"tok_s": None, "source": "none: no benchmarks.offline and no --offline-tok-s"}
    cmd = [sys.executable, "-m", "benchmarks.offline"]
    cmd += ["--model", args.model] if args.model else []
    cmd += shlex.split(args.offline_args)
    print(f"offline: {shlex.join(cmd)}", flush=True)
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=args.offline_timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return {"tok_s": None, "source": f"timed out: {shlex.join(cmd)}"}
    output = proc.stdout + proc.stderr
    (out_dir / "offline.log").write_text(output, encoding="utf-8")
    # The last "N tok/s" it prints is taken as its headline figure.
    found = re.findall(r"([\d][\d,]*(?:\.\d+)?)\s*tok(?:ens)?/s", output)
    tok_s = float(found[-1].replace(",", "")) if proc.returncode == 0 and found else None
    source = (
        shlex.join(cmd) if tok_s else f"no tok/s figure (rc={proc.returncode}): see offline.log"
    )
    return {"tok_s": tok_s, "source": source}


# ---------------------------------------------------------------- server


class Server:
    """`python -m server` in its own process group, killed on any exit."""

    def __init__(
        self, args: argparse.Namespace, out_dir: Path, launcher: tuple[str, ...] = ("-m", "server")
    ):
        self.port = args.port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, *launcher, "--host", "127.0.0.1"]
        self.command += ["--port", str(self.port)]
        self.command += ["--model", args.model] if args.model else []
        self.command += ["--enforce-eager"] if args.enforce_eager else []
        self.command += ["--log-stats-interval", str(STATS_INTERVAL_S)]
        self.command += shlex.split(args.server_args)
        self.log_path = out_dir / "server.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float, env: dict[str, str] | None = None) -> None:
        print(f"server: {shlex.join(self.command)}", flush=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not healthy after {timeout:g} s: {self.log_tail()}")

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        # The whole group: the server may have started workers of its own.
        for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=wait_s)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue


# ---------------------------------------------------------------- load tests


def run_loadtest(argv: list[str], out: Path) -> dict:
    """One `clients.loadtest` run; returns its result JSON (with the argv used)."""
    result_file = out.with_suffix(".json")
    argv = [*argv, "--result-file", str(result_file), "--plot-dir", str(out)]
    print(f"\n$ python -m clients.loadtest {shlex.join(argv)}", flush=True)
    rc = loadtest.main(argv)
    if not result_file.exists():
        raise RuntimeError(f"load test failed before measuring (rc={rc}): see its output above")
    return json.loads(result_file.read_text())


def sweep(
    args: argparse.Namespace,
    base: list[str],
    out_dir: Path,
    offline: float | None,
    server_log: Path | None = None,
) -> list:
    common = [
        *base, "--input-len-range", str(args.input_len), str(args.input_len), "--prompt-token-ids",
        "--output-len-range", str(args.output_len), str(args.output_len),
        "--seed", str(args.seed), "--timeout", str(args.request_timeout), "--warmup", "4",
    ]  # fmt: skip

    def run_rate(rate: float) -> dict:
        if math.isinf(rate):
            n = args.max_requests
        else:
            n = min(max(args.min_requests, int(rate * args.seconds_per_rate)), args.max_requests)
        name = "inf" if math.isinf(rate) else f"{rate:g}"
        argv = [*common, "--request-rate", name, "--num-requests", str(n)]
        return {"rate": name, **measured(argv, out_dir / f"rate_{name}")}

    def measured(argv: list[str], out: Path) -> dict:
        start = time.time()
        row = summarize(run_loadtest(argv, out), offline)
        row["engine"] = engine_window(server_log, start, time.time())
        return row

    rows: list[dict] = []
    best = 0.0
    for rate in sorted({r for r in args.rates if math.isfinite(r) and r > 0}):
        rows.append(run_rate(rate))
        if rows[-1]["output_throughput"] < SATURATION_GAIN * best:
            print(f"saturated at {rate:g} req/s: output throughput stopped growing", flush=True)
            break
        best = max(best, rows[-1]["output_throughput"])
    # Everything at once, then held at saturation: to set beside the offline figure.
    rows.append(run_rate(math.inf))
    for c in args.concurrency:
        n = args.concurrency_requests or args.max_requests
        argv = [*common, "--concurrency", str(c), "--num-requests", str(n)]
        # Overrides base's --workers: a client process holds at least one request.
        argv += ["--workers", str(min(args.client_workers, c))]
        rows.append(
            {"rate": f"c{c}", "concurrency": c, **measured(argv, out_dir / f"concurrency_{c}")}
        )
    return rows


def seeds_workload(base: list[str], out_dir: Path, model: str | None) -> dict:
    row = summarize(run_loadtest([*base, *SEEDS_ARGS], out_dir / "seeds"), None)
    row["seeds_output_tok_s"] = SEEDS_OUTPUT_TOK_S
    row["seeds_tpot_p50_ms"] = SEEDS_TPOT_P50_MS
    print("\nSeeds' workload: 64 x 'Hello' -> 128 tokens, 20 ms apart, ignore_eos")
    print(f"{'':<22}{'pagoda':>12}{'seeds (GPT-2)':>16}")
    print(f"{'output tok/s':<22}{fmt(row['output_throughput']):>12}{SEEDS_OUTPUT_TOK_S:>16.0f}")
    print(f"{'TPOT p50 (ms)':<22}{fmt(row['tpot_p50_ms'], '.2f'):>12}{SEEDS_TPOT_P50_MS:>16.1f}")
    if not model or "gpt2" not in model.lower():
        print("note: the seeds' figures are GPT-2 on GPU; compare only a GPT-2 run")
    return row


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    # SIGTERM (e.g. a job runner's timeout) unwinds like Ctrl-C, so the server dies too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    summary: dict = {
        "command": shlex.join([sys.executable, "-m", "benchmarks.serving", *argv]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "model": args.model or "embedded demo model",
    }
    summary["offline"] = offline_throughput(args, args.out_dir)
    offline = summary["offline"]["tok_s"]

    server = None if args.base_url else Server(args, args.out_dir)
    try:
        if server:
            summary["server_command"] = shlex.join(server.command)
            server.start(args.startup_timeout)
        base = ["--base-url", args.base_url or server.base_url, "--no-progress"]
        base += ["--workers", str(args.client_workers)]
        if not args.skip_sweep:
            log = server.log_path if server else None
            summary["sweep"] = sweep(args, base, args.out_dir, offline, log)
        if not args.skip_seeds:
            summary["seeds"] = seeds_workload(base, args.out_dir, args.model)
    except (RuntimeError, OSError) as e:
        summary["error"] = str(e)
        print(f"benchmark failed: {e}", file=sys.stderr)
    except (KeyboardInterrupt, SystemExit):
        summary["error"] = "interrupted"  # the partial summary is still written below
        raise
    finally:
        if server:
            server.stop()
        summary["gpu"] = gpu_name()  # after the server is gone: CUDA init here takes memory
        (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    if "sweep" in summary:
        print_sweep(summary["sweep"], offline)
        if plot_sweep(summary["sweep"], offline, args.out_dir / "sweep.png"):
            print(f"plot: {args.out_dir / 'sweep.png'}")
    print(f"\nsummary: {args.out_dir / 'summary.json'}")
    return 1 if "error" in summary else 0


if __name__ == "__main__":
    sys.exit(main())
