"""benchmarks.agreement on the CPU: its figures, and a whole run on a tiny checkpoint."""

from __future__ import annotations

import json

from benchmarks.agreement import by_length, free_running, main, make_prompts


def test_free_running_counts_positions_and_first_divergences():
    pagoda = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    hf = [[1, 2, 3, 4], [5, 0, 7, 0], [0, 9, 9, 9]]
    got = free_running(pagoda, hf, 4)
    assert got["token_agreement"] == 9 / 12
    assert got["mean_first_divergence"] == (4 + 1 + 0) / 3
    assert got["requests_identical"] == 1


def test_prompts_are_distinct_and_batched_by_length(tokenizer):
    prompts = make_prompts("random", 10, 500, tokenizer, seed=0)
    assert len({tuple(p) for p in prompts}) == 10
    assert [len(p) for p in prompts[:5]] == [16, 32, 48, 64, 16]
    text = make_prompts("text", 4, len(tokenizer), tokenizer, seed=0)
    assert [len(p) for p in text] == [16, 32, 48, 64]
    batches = by_length(prompts, 2)
    assert sorted(i for b in batches for i in b) == list(range(10))
    assert all(len({len(prompts[i]) for i in b}) == 1 and len(b) <= 2 for b in batches)


def test_float32_on_the_cpu_agrees_everywhere(tiny_llama_dir, tmp_path):
    out = tmp_path / "agreement.json"
    argv = ["--model-dir", tiny_llama_dir, "--device", "cpu", "--dtype", "float32"]
    argv += ["--num-requests", "4", "--max-tokens", "6", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["free_running"]["positions"] == 24
    assert result["free_running"]["token_agreement"] == 1.0
    assert result["teacher_forced"]["top1_agreement"] == 1.0
    assert result["teacher_forced"]["gap_at_disagreements"] is None
    assert result["commit"] and result["passes_bar"]
