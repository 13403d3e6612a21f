"""What each server process costs per request and per streamed token, on any machine:
the engine's forward is stubbed out.

    python -m benchmarks.api_cost                                   # --engine-process
    python -m benchmarks.api_cost --server-args "--api-server-count 2"
    python -m benchmarks.api_cost --profile /tmp/api.prof           # cProfile the API process

On the GPU, serving throughput was capped by the API process's Python, not by
the engine. That cost does not depend on the model, so here the server runs the
real engine around a forward that returns zeros (`benchmarks.host_step`), the
load test streams `--num-requests` completions at `--concurrency`, and the figure
is each server process's CPU time (user + system, from /proc) per request and
per output token. CPU time, unlike throughput, holds on a small shared box where
the load test competes for the same cores; compare commits side by side.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.provenance import git_commit
from benchmarks.serving import Server
from clients import loadtest

ENGINE_PID_FILE = "PAGODA_API_COST_ENGINE_PID_FILE"
PROFILE_FILE = "PAGODA_API_COST_PROFILE"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def stub_engine(config):
    """The real engine with its forward stubbed out (picklable: a spawned engine
    process calls it). It records its pid, so the engine process can be told apart."""
    from benchmarks.host_step import stub_forward
    from server.app import build_engine

    engine = build_engine(config)
    stub_forward(engine)
    if os.environ.get(ENGINE_PID_FILE):
        Path(os.environ[ENGINE_PID_FILE]).write_text(str(os.getpid()))
    return engine


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


def descendants(pid: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry.name))
    return children + [d for c in children for d in descendants(c)]


def server_processes(root: int, engine_pid: int) -> dict[str, int]:
    """Role -> pid: the engine, and the API process(es) (the root itself unless it
    is a supervisor of several). multiprocessing's resource tracker is left out.
    Without --engine-process the engine is a thread of the one server process."""
    if engine_pid == root:
        return {"api+engine": root}
    roles = {"engine": engine_pid}
    apis = []
    for pid in descendants(root):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if pid != engine_pid and b"resource_tracker" not in cmdline:
            apis.append(pid)
    if not apis:
        roles["api"] = root
    else:
        roles["supervisor"] = root
        roles.update({f"api{i}": pid for i, pid in enumerate(sorted(apis))})
    return roles


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--server-args",
        default="--engine-process",
        help="server flags (the demo model, on the CPU; the forward is stubbed); without "
        "--engine-process the engine is a thread and one figure covers both",
    )
    p.add_argument("--num-requests", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32, help="prompt words (the load test's)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (EOS ignored)")
    p.add_argument("--workers", type=int, default=1, help="load-test client processes")
    p.add_argument(
        "--profile",
        type=Path,
        help="cProfile the server's main process (the API process, unless there are several)",
    )
    p.add_argument("--result-file", type=Path, help="write the figures as JSON")
    p.add_argument("--serve", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # internal
    return p


def serve(argv: list[str], profile: str | None) -> int:
    """The server, with the stubbed engine (run as this module's subprocess)."""
    from server.cli import serve as cli_serve

    if not profile:
        return cli_serve(argv, prog="benchmarks.api_cost", engine_factory=stub_engine)
    # uvicorn re-raises SIGTERM after draining: exit through Python, so the stats are written.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    profiler = cProfile.Profile()
    try:
        return profiler.runcall(
            cli_serve, argv, prog="benchmarks.api_cost", engine_factory=stub_engine
        )
    finally:
        profiler.dump_stats(profile)


def measure(args: argparse.Namespace, out_dir: Path) -> dict:
    pid_file = out_dir / "engine.pid"
    env = os.environ | {ENGINE_PID_FILE: str(pid_file)}  # the server's processes inherit it
    if args.profile:
        env[PROFILE_FILE] = str(args.profile.resolve())
    server_args = f"--device cpu {args.server_args}"
    server = Server(
        argparse.Namespace(port=None, model=None, enforce_eager=False, server_args=server_args),
        out_dir,
        launcher=("-m", "benchmarks.api_cost", "--serve"),
    )
    server.start(timeout=300, env=env)
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        if not pid_file.exists():
            raise RuntimeError("the engine never recorded its pid")
        roles = server_processes(server.proc.pid, int(pid_file.read_text()))
        base = [
            "--base-url", server.base_url, "--input-len-range", str(args.input_len), str(args.input_len),
            "--output-len-range", str(args.output_len), str(args.output_len), "--ignore-eos",
            "--concurrency", str(args.concurrency), "--workers", str(args.workers), "--no-progress",
        ]  # fmt: skip
        warm = out_dir / "warmup.json"
        loadtest.main([*base, "--num-requests", str(args.concurrency), "--result-file", str(warm)])
        before = {role: cpu_seconds(pid) for role, pid in roles.items()}
        start = time.perf_counter()
        result_file = out_dir / "loadtest.json"
        rc = loadtest.main(
            [*base, "--num-requests", str(args.num_requests), "--result-file", str(result_file)]
        )
        wall = time.perf_counter() - start
        after = {role: cpu_seconds(pid) for role, pid in roles.items()}
    finally:
        server.stop()
    metrics = json.loads(result_file.read_text())["metrics"]
    completed, tokens = metrics["completed"], metrics["total_output_tokens"]
    if rc != 0 or completed != args.num_requests:
        raise RuntimeError(f"load test rc={rc}, {completed}/{args.num_requests} completed")
    cpu = {role: after[role] - before[role] for role in roles}
    return {
        "server_args": args.server_args,
        "num_requests": completed,
        "output_tokens": tokens,
        "concurrency": args.concurrency,
        "wall_s": round(wall, 2),
        "cpu_s": {role: round(s, 2) for role, s in cpu.items()},
        "cpu_us_per_request": {role: round(1e6 * s / completed) for role, s in cpu.items()},
        "cpu_us_per_token": {role: round(1e6 * s / tokens, 1) for role, s in cpu.items()},
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.serve is not None:
        return serve(args.serve, os.environ.get(PROFILE_FILE))
    with tempfile.TemporaryDirectory(prefix="pagoda-api-cost-") as tmp:
        figures = measure(args, Path(tmp))
    command = shlex.join(["python", "-m", "benchmarks.api_cost", *(argv or sys.argv[1:])])
    figures = {"commit": git_commit(), "command": command} | figures
    print(json.dumps(figures, indent=1))
    if args.result_file:
        args.result_file.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
