"""Time to ready: `python -m server --model DIR` until GET /health answers 200.

    python -m benchmarks.startup --model llama3-8b --runs 4 --drop-caches \
        --out benchmarks/results/startup-llama3-8b-h100.json
    python -m benchmarks.startup --model demo --runs 3  # on the CPU, the demo model
    python -m benchmarks.startup --model llama3-8b \
        --server-args="--cuda-graph-sizes 1 2 4 8 16 32 64 128 256"  # fewer decode graphs

The checkpoint is written to disk once and reused (benchmarks.checkpoints
disk_checkpoint: for llama3-8b, random bf16 shards at Llama-3-8B's shapes, the
16 GB the real weights take to read); `demo` starts the server on its embedded
demo model; `--model-dir` serves any checkpoint. Each run starts the server as
a subprocess, polls /health every few milliseconds, and stamps every log line
as it arrives, so that the time to ready splits into phases at the startup
log's lines (the API side's imports, the engine's, the model config, weights,
KV cache, decode and prefill graph capture, the rest).

The first run reads the weights from disk only if the page cache does not hold
them: `--drop-caches` empties it first (root only) and calls that run "cold";
without it, or if dropping fails, the first run is called "first". The other
runs are "warm". Compiled Triton kernels are cached across runs
(TRITON_CACHE_DIR or ~/.triton/cache): each run records whether that cache
had entries before it started, since a first run on a fresh machine compiles
every kernel.

Python's bytecode is cached too, as an installed package has it (pip compiles
every module at install): PYTHONDONTWRITEBYTECODE is dropped from the server's
environment and, unless PYTHONPYCACHEPREFIX is set, bytecode goes to a
directory of its own, so read-only or no-bytecode environments (some GPU
machines set PYTHONDONTWRITEBYTECODE) do not recompile torch's and
transformers' thousands of modules on every start.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.provenance import provenance, write_result

POLL_S = 0.005  # a benchmark, not a test: the ready instant matters to the millisecond

# The startup log's milestones, in the order they appear (uvicorn, engine/engine.py,
# engine/model_runner.py, engine/cuda_graphs.py, server/app.py). With
# --engine-process, "app_startup" comes before the engine process is spawned.
MARKERS = {
    "app_startup": re.compile(r"Waiting for application startup"),  # uvicorn: the lifespan
    "building": re.compile(r"pagoda\.engine.*: building the engine"),
    "loading": re.compile(r"pagoda\.engine.*: loading "),
    "weights_loaded": re.compile(r"pagoda\.engine.*: weights loaded"),
    "kv_cache": re.compile(r"pagoda\.engine.*: KV cache: "),
    "capturing_decode": re.compile(r"pagoda\.engine.*: capturing decode graphs"),
    "decode_captured": re.compile(r"pagoda\.engine.*: decode graphs captured"),
    "capturing_prefill": re.compile(r"pagoda\.engine.*: capturing prefill graphs"),
    "prefill_captured": re.compile(r"pagoda\.engine.*: prefill graphs captured"),
    "engine_ready": re.compile(r"pagoda\.engine.*: engine ready"),
    "serving": re.compile(r"pagoda\.server.*: serving "),
}
# Phase name -> (from marker, to marker); "spawn" is the Popen, "ready" the first 200.
PHASES = {
    "before_loading": ("spawn", "loading"),  # all of the three below
    "api_imports": ("spawn", "app_startup"),  # the interpreter, the HTTP side's modules
    "engine_imports": ("app_startup", "building"),  # torch, Triton, the model code
    "model_config": ("building", "loading"),  # transformers' config, the model on meta
    "weights": ("loading", "weights_loaded"),
    "kv_cache": ("weights_loaded", "kv_cache"),
    "decode_graphs": ("capturing_decode", "decode_captured"),
    "prefill_graphs": ("capturing_prefill", "prefill_captured"),
    "engine_ready": ("loading", "engine_ready"),
    "after_engine": ("engine_ready", "ready"),  # the API side's own startup, uvicorn
}


@dataclass
class Run:
    label: str  # "cold", "first" or "warm"
    ready_s: float | None  # None: the server exited or timed out first
    triton_cache_warm: bool
    markers: dict[str, float] = field(default_factory=dict)  # seconds after spawn
    phases: dict[str, float] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)  # "  1.23 <line>", up to the ready


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def triton_cache_warm() -> bool:
    root = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return root.is_dir() and any(root.iterdir())


def server_env(base: Mapping[str, str]) -> dict[str, str]:
    """The server's environment: unbuffered logs, bytecode cached (see the module doc)."""
    env = {k: v for k, v in base.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("PYTHONPYCACHEPREFIX", str(Path(tempfile.gettempdir()) / "pagoda-pycache"))
    return env


def versions(*packages: str) -> dict[str, str | None]:
    """Installed versions, read from package metadata (nothing imported)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in packages:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def drop_caches() -> bool:
    """Empty the page cache (root only); True if it was."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError as exc:
        print(f"cannot drop the page cache ({exc}): the first run is not cold", file=sys.stderr)
        return False


def checkpoint(args: argparse.Namespace) -> str | None:
    """The model directory to serve (None: the demo model)."""
    if args.model_dir:
        return args.model_dir
    if args.model == "demo":
        return None
    from benchmarks.checkpoints import disk_checkpoint

    # In a process of its own: this one must not hold a CUDA context (and its memory)
    # while the server sizes its KV cache.
    with concurrent.futures.ProcessPoolExecutor(
        1, mp_context=multiprocessing.get_context("spawn")
    ) as pool:
        return pool.submit(disk_checkpoint, args.model, args.dtype, args.checkpoint_dir).result()


def time_to_ready(
    command: list[str], port: int, label: str, timeout: float, env: dict[str, str]
) -> Run:
    run = Run(label, None, triton_cache_warm())
    start = time.perf_counter()
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,  # its engine process (if any) goes with it
    )
    lines: list[tuple[float, str]] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.perf_counter() - start, line.rstrip()))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}/health"
    try:
        while time.perf_counter() - start < timeout and proc.poll() is None:
            try:
                with urllib.request.urlopen(url, timeout=1) as response:
                    if response.status == 200:
                        run.ready_s = time.perf_counter() - start
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(POLL_S)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(5)
    end = run.ready_s if run.ready_s is not None else float("inf")
    for t, line in lines:
        if t > end:
            break
        run.log.append(f"{t:7.3f} {line}")
        for name, pattern in MARKERS.items():
            if name not in run.markers and pattern.search(line):
                run.markers[name] = round(t, 4)
    if run.ready_s is None:
        run.log += [f"{t:7.3f} {line}" for t, line in lines[-40:] if t > end]
        return run
    at = {"spawn": 0.0, "ready": run.ready_s, **run.markers}
    for phase, (a, b) in PHASES.items():
        if a in at and b in at:
            run.phases[phase] = round(at[b] - at[a], 4)
    return run


def summarize(runs: list[Run]) -> dict:
    warm = [r.ready_s for r in runs if r.label == "warm" and r.ready_s is not None]
    first = runs[0]
    out: dict = {"first_label": first.label, "first_ready_s": first.ready_s}
    if warm:
        out["warm_ready_s"] = {
            "median": statistics.median(warm),
            "min": min(warm),
            "max": max(warm),
            "n": len(warm),
        }
        warm_runs = [r for r in runs if r.label == "warm" and r.ready_s is not None]
        out["warm_phases_median_s"] = {
            phase: statistics.median(r.phases[phase] for r in warm_runs)
            for phase in PHASES
            if all(phase in r.phases for r in warm_runs)
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        default="llama3-8b",
        choices=["llama3-8b", "gpt2", "qwen2-0.5b", "demo"],
        help="random-weight checkpoint to write (or reuse), or the embedded demo model",
    )
    p.add_argument("--model-dir", default=None, help="serve this checkpoint instead")
    p.add_argument("--checkpoint-dir", default=None, help="where to write (or find) it")
    p.add_argument("--dtype", default="bfloat16", help="of a checkpoint written here")
    p.add_argument("--runs", type=int, default=3, help="server starts, one after another")
    p.add_argument(
        "--drop-caches",
        action="store_true",
        help="empty the page cache before the first run (root only), making it cold",
    )
    p.add_argument(
        "--server-args",
        default="",
        help='more server flags, given with "=": --server-args="--enforce-eager"',
    )
    p.add_argument("--port", type=int, default=None, help="default: a free port")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one start may take")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be at least 1")

    model_dir = checkpoint(args)
    port = args.port or free_port()
    command = [sys.executable, "-m", "server", "--port", str(port)]
    if model_dir is not None:
        command += ["--model", model_dir]
    command += shlex.split(args.server_args)
    env = server_env(os.environ)
    runs = []
    for i in range(args.runs):
        label = "warm"
        if i == 0:
            label = "cold" if args.drop_caches and drop_caches() else "first"
        run = time_to_ready(command, port, label, args.timeout, env)
        runs.append(run)
        shown = f"{run.ready_s:.2f} s" if run.ready_s is not None else "never (see its log)"
        phases = ", ".join(f"{k} {v:.2f}" for k, v in run.phases.items())
        print(f"{label}: ready in {shown} ({phases})", file=sys.stderr)
    result = {
        **provenance("startup", argv),
        "device": device_name(),
        "model": args.model_dir or args.model,
        "server_command": command,
        "versions": versions("torch", "triton", "transformers", "tokenizers"),
        "bytecode_cache": env["PYTHONPYCACHEPREFIX"],
        "note": "ready_s: spawn to the first 200 from /health. markers: seconds after spawn "
        "at which each startup log line arrived; phases: differences of them. 'cold' only "
        "when the page cache was dropped before the run; 'first' may have had the "
        "weights cached. triton_cache_warm: compiled kernels were on disk before the run.",
        "summary": summarize(runs),
        "runs": [asdict(r) for r in runs],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    write_result(args.out, result)
    return 0 if all(r.ready_s is not None for r in runs) else 1


def device_name() -> str:
    """The GPU's name without initialising CUDA here (the server must have it to itself)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return f"cpu ({os.cpu_count()} cores)"


if __name__ == "__main__":
    sys.exit(main())
