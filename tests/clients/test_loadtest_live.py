"""The load test against the real Pagoda server (embedded demo model, CPU)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

from clients import loadtest
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 120


def wait_for_health(proc: subprocess.Popen, base_url: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
            )
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"no /health in {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


def test_loadtest_against_pagoda_server(tmp_path):
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "server", "--port", str(port), "--max-model-len", "256"],
            cwd=ROOT,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for_health(proc, base_url, log)
        result_file = tmp_path / "result.json"
        rc = loadtest.main(
            [
                "--base-url", base_url, "--prompt", "Hello", "--num-requests", "8",
                "--concurrency", "4", "--max-tokens", "16", "--ignore-eos", "--timeout", "60",
                "--no-progress", "--result-file", str(result_file),
            ]
        )  # fmt: skip
        result = json.loads(result_file.read_text())
        errors = [r["error"] for r in result["records"] if r["error"]]
        assert rc == 0 and not errors, errors
        metrics = result["metrics"]
        assert metrics["completed"] == 8 and metrics["usage_missing"] == 0
        for record in result["records"]:
            assert record["completion_tokens"] == 16  # from the server's usage chunk
            assert record["prompt_tokens"] > 0
            assert record["chunk_times"], "no content chunks"
        assert metrics["total_output_tokens"] == 8 * 16
        assert metrics["ttft"]["count"] == 8 and metrics["tpot"]["count"] == 8
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
