"""benchmarks.profile_decode on the CPU: the host's ops per full-batch decode step, and
the device's idle stretches from a timeline of kernels."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks.profile_decode import idle_gaps, kernel_table
from engine import LLM


def test_the_table_adds_up_over_full_batch_steps():
    llm = LLM(None, device="cpu", max_num_seqs=4, max_model_len=256, enable_prefix_caching=False)
    table = kernel_table(llm, batch=4, context=16, steps=3)
    rows = table["rows"]
    assert rows and all(row["us_per_step"] > 0 and row["calls"] > 0 for row in rows)
    assert [row["us_per_step"] for row in rows] == sorted(
        (row["us_per_step"] for row in rows), reverse=True
    )
    assert abs(sum(row["us_per_step"] for row in rows) - table["us_per_step"]) < 1e-6
    assert len(llm.engine.scheduler.running) == 4  # nobody finished inside the table


def test_idle_stretches_follow_the_last_kernel_to_end():
    def kernel(name: str, start: float, end: float) -> SimpleNamespace:
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))

    timeline = [
        kernel("void add<float>(float*)", 0, 10),
        kernel("copy", 20, 21),  # 10 idle after add
        kernel("gemm", 21, 40),
        kernel("norm", 30, 35),  # overlaps gemm (PDL): no idle
        kernel("Memcpy HtoD (Pinned -> Device)", 44, 45),  # 4 idle after gemm, not norm
        kernel("copy", 52, 53),  # 7 idle
    ]
    gaps = idle_gaps(timeline[::-1], steps=2)  # any order: sorted by start
    assert gaps["idle_us_per_step"] == 10.5
    assert gaps["idle_gaps"] == [
        {"between": "add -> copy", "us_per_step": 5.0, "per_step": 0.5},
        {"between": "Memcpy HtoD -> copy", "us_per_step": 3.5, "per_step": 0.5},
        {"between": "gemm -> Memcpy HtoD", "us_per_step": 2.0, "per_step": 0.5},
    ]
