"""benchmarks.api_cost keeps running: a live server on the stubbed engine, its
processes told apart, and CPU time charged per request and per token."""

from __future__ import annotations

import json

from benchmarks.api_cost import main


def test_api_cost_measures_the_api_and_engine_processes(tmp_path):
    out = tmp_path / "cost.json"
    argv = ["--num-requests", "24", "--concurrency", "4", "--output-len", "8"]
    assert main([*argv, "--result-file", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert (figures["num_requests"], figures["output_tokens"]) == (24, 24 * 8)
    assert set(figures["cpu_s"]) == {"api", "engine"}
    # The API process parsed and streamed every request: it cannot have been idle.
    assert figures["cpu_s"]["api"] > 0
    per_request, per_token = (
        figures["cpu_us_per_request"]["api"],
        figures["cpu_us_per_token"]["api"],
    )
    assert abs(per_token * 8 - per_request) <= 1  # 8 tokens a request
