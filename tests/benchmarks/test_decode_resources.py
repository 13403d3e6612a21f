"""benchmarks.decode_resources: a decode launch's footprint on an SM, read from the kernel
compiled for sm_90 on the CPU, and the programs an SM that leaves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.hopper_compile import Footprint


def test_programs_an_sm_follow_registers_warps_and_shared_memory() -> None:
    # Registers go to each warp in blocks of 256 (80 a thread: 2,560 a warp, 25 warps of
    # 65,536); shared memory holds 1 KB more a program than the kernel asks.
    assert Footprint(80, 0, 20736, 4).programs_per_sm() == 6
    assert Footprint(72, 0, 20480, 4).programs_per_sm() == 7
    assert Footprint(255, 0, 40960, 2).programs_per_sm() == 4
    assert Footprint(32, 0, 100 * 1024, 4).programs_per_sm() == 2  # shared memory's limit
    assert Footprint(16, 0, 1024, 1).programs_per_sm() == 32  # at most 32 programs
    assert Footprint(16, 0, 1024, 8).programs_per_sm() == 8  # at most 64 warps


def test_bf16_launches_are_read_from_their_cubins_and_spill_nothing(tmp_path: Path) -> None:
    # In a child process: this one's kernels were re-decorated for the interpreter. A
    # kernel change that spills (registers read back from local memory) fails here.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "resources.json"
    argv = ["--model", "gpt2", "--model", "qwen2-0.5b", "--model", "llama3-8b"]
    argv += ["--batch", "1", "32", "64", "256", "--kv-cache-dtype", "auto", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.decode_resources", *argv],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["command"] == "python -m benchmarks.decode_resources " + " ".join(argv)
    runs = result["runs"]
    assert list(runs) == ["gpt2, kv auto", "qwen2-0.5b, kv auto", "llama3-8b, kv auto"]
    for rows in runs.values():
        assert [row["batch"] for row in rows] == [1, 32, 64, 256]
        for row in rows:
            assert 32 <= row["registers"] <= 255 and row["local_bytes"] == 0, row
            footprint = Footprint(
                row["registers"], row["local_bytes"], row["shared_bytes"], row["num_warps"]
            )
            assert row["programs_per_sm"] == footprint.programs_per_sm()
            programs = row["programs"]
            assert row["waves"] == round(programs / (row["programs_per_sm"] * 132), 2)
    # GPT-2 at 64 sequences: 768 (sequence, head) programs, past 4 an SM of 132, run
    # unsplit on 64-token tiles, each holding a K and a V tile at least.
    row = runs["gpt2, kv auto"][2]
    assert row["config"] == {"num_splits": 1, "block_n": 64, "num_warps": 4, "num_stages": 3}
    assert row["programs"] == 768 and row["shared_bytes"] > 2 * 64 * 64 * 2
