"""benchmarks.profile_decode on the CPU: the host's ops per full-batch decode step."""

from __future__ import annotations

from benchmarks.profile_decode import kernel_table
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
