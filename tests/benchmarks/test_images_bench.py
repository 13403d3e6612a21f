"""benchmarks.images on the CPU: a whole tiny run (a random-weights multimodal
checkpoint, every request's tokens on both sides)."""

from __future__ import annotations

import json

from benchmarks.images import main


def test_a_tiny_run_serves_every_request_on_both_sides(tmp_path):
    out = tmp_path / "images.json"
    argv = ["--tiny", "--requests", "3", "--image", "56", "--max-tokens", "5", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["workload"]["image_tokens"] == 4  # 56 px: 4 x 4 patches, merged 2 x 2
    assert result["pagoda"]["output_tokens"] == result["transformers"]["output_tokens"] == 15
    assert result["pagoda"]["ttft_max_s"] <= result["pagoda"]["wall_s"]
    assert result["pagoda"]["prefix_cache_hit_tokens"] == 0  # the warm-up's images differ
    assert result["commit"]
