"""benchmarks.tp_scaling's measurement on the CPU (gloo), on short runs. In a module of
its own: it builds a TP 2 engine while no other holds this process's group."""

from __future__ import annotations


def test_each_engine_is_measured_in_a_process_of_its_own(tiny_llama_dir, monkeypatch):
    """measure_apart, end to end on short runs: the child measures with this process's
    lengths, its JSON line comes back with the batch-1 figures and the profiled
    collectives (gloo here), and says whether the engine summed one-shot (never on the
    CPU: no peer memory)."""
    from benchmarks import tp_scaling

    monkeypatch.setattr(tp_scaling, "BATCH1_PROMPT", 8)
    monkeypatch.setattr(tp_scaling, "BATCH1_OUTPUT", 6)
    monkeypatch.setattr(tp_scaling, "PROFILED_TOKENS", 3)
    monkeypatch.setattr(tp_scaling, "THROUGHPUT_LEN", 32)  # sets max_model_len too
    result = tp_scaling.measure_apart(tiny_llama_dir, 2, 1e11, throughput=False, one_shot=True)
    assert result["one_shot_in_use"] is False
    batch1 = result["batch1"]
    assert batch1["ms_per_token"] > 0 and batch1["vs_floor"] > 0
    assert 0 < batch1["profiled"]["collective_us_per_token"] < batch1["profiled"]["step_us"]
