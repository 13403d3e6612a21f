"""benchmarks.prefix_ttft on the CPU: each case's prompts hit the cached prefix, and the
result has both times."""

from __future__ import annotations

import json

from benchmarks import prefix_ttft


def test_prefix_ttft_times_cached_and_uncached_prompts(tiny_llama_dir, tmp_path):
    out = tmp_path / "ttft.json"
    argv = [
        "--model", tiny_llama_dir, "--device", "cpu", "--dtype", "float32",
        "--cases", "32:4", "64:8", "--repeats", "2", "--out", str(out),
    ]  # fmt: skip
    assert prefix_ttft.main(argv) == 0
    result = json.loads(out.read_text())
    # Every timed cached prompt found its whole prefix, and so did the second prompt that
    # cached it (the uncached ones found none).
    assert result["prefix_cache_hits"] == 3 * 32 + 3 * 64
    for case in result["cases"]:
        assert case["cached_ttft_ms"] > 0 and case["uncached_ttft_ms"] > 0
    assert [(c["cached_prefix"], c["new_tokens"]) for c in result["cases"]] == [(32, 4), (64, 8)]


def test_a_recurrent_model_starts_from_the_states_saved_where_its_prefix_ends(
    tiny_family_dir, tmp_path
):
    out = tmp_path / "ttft.json"
    argv = [
        "--model", tiny_family_dir("qwen3_5"), "--device", "cpu", "--dtype", "float32",
        "--cases", "32:20", "--repeats", "2", "--max-num-seqs", "4", "--compare-off",
        "--out", str(out),
    ]  # fmt: skip
    assert prefix_ttft.main(argv) == 0
    result = json.loads(out.read_text())
    # The first caching prompt saved its states at 48 tokens (its last block boundary),
    # the second found the prefix's KV blocks without states, and saved them at 32.
    assert result["state_snapshots"] == 4 and result["prefix_cache_hits"] == 2 * 32
    assert result["cases"][0]["uncached_ttft_ms_cache_off"] > 0


def test_transformers_new_tokens_run_over_the_prefix_cache_each_time(tiny_llama_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    seen = []
    forward = model.forward

    def counted(input_ids, past_key_values=None, **kw):
        past = 0 if past_key_values is None else past_key_values.get_seq_length()
        seen.append((input_ids.shape[1], past))
        return forward(input_ids, past_key_values=past_key_values, **kw)

    model.forward = counted
    ms = prefix_ttft.hf_new_tokens_ms(model, list(range(5, 25)), [[7, 8, 9], [10, 11, 12]])
    assert ms > 0
    # The prefix's forward, then each new chunk (a warm-up first) over exactly the prefix.
    assert seen == [(20, 0), (3, 20), (3, 20), (3, 20)]
