"""The load test against the real Pagoda server (embedded demo model, CPU)."""

import json

from clients import loadtest
from tests.server.live_server import ServerProcess


def test_loadtest_against_pagoda_server(tmp_path):
    server = ServerProcess(["--max-model-len", "256"], tmp_path / "server.log")
    base_url = server.base_url
    try:
        server.wait_ready()
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
        server.close()
