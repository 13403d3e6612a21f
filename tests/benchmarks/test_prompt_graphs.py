"""benchmarks.prompt_graphs on the CPU (no graphs there: both ways run eagerly): a row
per length, alone and beside decoding sequences, each with both timings."""

from __future__ import annotations

import json

from benchmarks import prompt_graphs


def test_prompt_graphs_times_each_length_alone_and_beside_decodes(tiny_family_dir, tmp_path):
    out = tmp_path / "pg.json"
    argv = ["--model", tiny_family_dir("qwen3_5"), "--dtype", "float32", "--lengths", "2", "9"]
    argv += ["--beside", "3", "--repeats", "2", "--max-num-seqs", "8"]
    argv += ["--max-model-len", "256", "--out", str(out)]
    assert prompt_graphs.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["walk_limit"] == 0 and result["prefill_graph_buckets"] == []
    rows = [(r["beside"], r["prompt_tokens"]) for r in result["rows"]]
    assert rows == [(0, 2), (0, 9), (3, 2), (3, 9)]
    assert all(r["graphs_ttft_ms"] > 0 and r["eager_ttft_ms"] > 0 for r in result["rows"])
