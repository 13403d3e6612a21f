"""benchmarks/serving.py against the fake server (--base-url: no server to start)."""

import json

from benchmarks import serving


def test_sweep_and_seeds_workload(fake, tmp_path, capsys):
    fake.delay_s = 0.001
    out = tmp_path / "bench"
    rc = serving.main(
        [
            "--base-url", fake.base_url, "--rates", "20", "40", "--seconds-per-rate", "0.2",
            "--min-requests", "4", "--max-requests", "8", "--input-len", "4",
            "--output-len", "4", "--offline-tok-s", "1000", "--concurrency", "3",
            "--out-dir", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["command"].endswith(f"--out-dir {out}")
    assert summary["date"] and "gpu" in summary and "git_commit" in summary
    assert summary["offline"] == {"tok_s": 1000.0, "source": "--offline-tok-s"}
    rates = [row["rate"] for row in summary["sweep"]]
    assert rates[-2:] == ["inf", "c3"] and set(rates[:-2]) <= {"20", "40"}
    assert summary["sweep"][-1]["concurrency"] == 3
    closed = json.loads((out / "concurrency_3.json").read_text())
    assert closed["config"]["concurrency"] == 3 and len(closed["records"]) == 8
    for row in summary["sweep"]:
        assert row["failed"] == 0 and row["completed"] >= 4
        assert row["output_vs_offline"] == row["output_throughput"] / 1000.0
    seeds = summary["seeds"]
    assert seeds["completed"] == 64 and seeds["failed"] == 0
    assert seeds["seeds_output_tok_s"] == 3211.0 and seeds["seeds_tpot_p50_ms"] == 11.8
    # The seeds' workload: "Hello", 128 tokens, ignore_eos, 20 ms apart.
    seeds_run = json.loads((out / "seeds.json").read_text())
    assert all(r["completion_tokens"] == 128 for r in seeds_run["records"])
    assert fake.bodies[-1]["prompt"] == "Hello" and fake.bodies[-1]["ignore_eos"] is True
    config = seeds_run["config"]
    assert (config["request_rate"], config["burstiness"]) == (50.0, "inf")  # 20 ms apart
    sends = [r["send_time"] for r in seeds_run["records"]]
    # Sent on the 20 ms grid or late (the fake server shares this process's CPU), never early.
    assert all(t >= i * 0.020 - 1e-3 for i, t in enumerate(sends))
    out_text = capsys.readouterr().out
    assert "Rate sweep" in out_text and "3211" in out_text


def test_unreachable_server_fails_cleanly(tmp_path):
    rc = serving.main(
        ["--base-url", "http://127.0.0.1:9", "--skip-sweep", "--out-dir", str(tmp_path)]
    )
    assert rc == 1
    assert "error" in json.loads((tmp_path / "summary.json").read_text())
