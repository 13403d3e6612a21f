"""benchmarks.embedding on the CPU: Pagoda's and transformers' (padded, batched by
length) embeddings of the same prompts agree, and each run is timed."""

from __future__ import annotations

import json

from benchmarks import embedding


def test_embedding_benchmark_agrees_with_transformers(tiny_encoder_dir, tmp_path):
    out = tmp_path / "embedding.json"
    argv = [
        "--model", tiny_encoder_dir("bert_cls"), "--dtype", "float32", "--num-requests", "40",
        "--min-len", "3", "--max-len", "100", "--max-num-batched-tokens", "128", "512",
        "--compare-hf", "--hf-batch-size", "8", "--out", str(out),
    ]  # fmt: skip
    assert embedding.main(argv) == 0
    result = json.loads(out.read_text())
    assert [r.get("max_num_batched_tokens") for r in result["runs"]] == [128, 512, None]
    assert all(r["tok_s"] > 0 and r["tflops"] >= 0 for r in result["runs"])
    assert result["cosine_vs_transformers"]["min"] > 0.9999  # padding masked, CLS pooled
