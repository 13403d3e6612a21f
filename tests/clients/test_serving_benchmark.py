"""benchmarks/serving.py against the fake server (--base-url: no server to start)."""

import argparse
import json
import logging
import threading
from datetime import datetime, timedelta
from unittest import mock

import pytest

from benchmarks import serving, serving_report
from server import engine_loop
from server.engine_loop import StatLog
from tests.server.test_stat_log import FakeEngine


def test_sweep_and_seeds_workload(fake, tmp_path, capsys):
    fake.delay_s = 0.001
    out = tmp_path / "bench"
    rc = serving.main(
        [
            "--base-url", fake.base_url, "--rates", "20", "40", "--seconds-per-rate", "0.2",
            "--min-requests", "4", "--max-requests", "8", "--input-len", "4",
            "--output-len", "4", "--offline-tok-s", "1000", "--concurrency", "3",
            "--concurrency-requests", "10", "--out-dir", str(out),
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
    assert closed["config"]["concurrency"] == 3 and len(closed["records"]) == 10
    assert json.loads((out / "rate_inf.json").read_text())["config"]["num_requests"] == 8
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
    args = ["--base-url", "http://127.0.0.1:9", "--skip-sweep", "--out-dir", str(tmp_path)]
    rc = serving.main([*args, "--offline-tok-s", "1000"])  # no offline run: it is not the point
    assert rc == 1
    assert "error" in json.loads((tmp_path / "summary.json").read_text())


def stats_line(when: datetime, steps: int, waiting: int, idle: int) -> str:
    """A server.log line with StatLog's own message (so the parser follows its format);
    the host worked the rest of the second."""
    engine, log = FakeEngine(), StatLog(interval_s=0.0)
    elapsed = 1.0  # exactly: the clock the line is logged at (a busy box adds to a real one)
    clock = mock.patch.object(engine_loop.time, "monotonic", return_value=log._start + elapsed)
    engine.runner.steps_by_path["graph"] = steps * elapsed
    engine.runner.wait_s = waiting / 100 * elapsed
    log.idle(idle / 100 * elapsed)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("pagoda.server")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)  # not `.level =`: that leaves isEnabledFor's cached answer
    try:
        with clock:
            log.maybe_log(engine)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    stamp = when.strftime("%Y-%m-%d %H:%M:%S,") + f"{when.microsecond // 1000:03d}"
    return f"{stamp} INFO pagoda.server (engine process): {records[0].getMessage()}"


def test_engine_window_averages_the_stats_lines_logged_during_a_run(tmp_path):
    t = datetime(2026, 11, 23, 10, 0, 1)
    log = tmp_path / "server.log"
    log.write_text(
        "\n".join(
            [
                stats_line(t - timedelta(seconds=0.5), 50, 0, 90),  # before the run
                f"{t:%Y-%m-%d %H:%M:%S},000 INFO uvicorn.error: something else",
                stats_line(t + timedelta(seconds=0.9), 300, 5, 5),
                stats_line(t + timedelta(seconds=1.9), 500, 0, 0),
                stats_line(t + timedelta(seconds=8), 40, 0, 95),  # after it
            ]
        )
    )
    start = t.timestamp()  # local time, as logged
    window = serving_report.engine_window(log, start, start + 2.0)
    assert window is not None and window["lines"] == 2
    assert (window["steps_per_s"], window["graph_pct"]) == (400.0, 100.0)
    assert window["host_working_pct"] == pytest.approx(95.0, abs=1)
    assert serving_report.engine_window(log, start + 100, start + 101) is None
    assert serving_report.engine_window(None, start, start + 2.0) is None


def test_a_started_server_logs_stats_every_second_unless_told_otherwise(tmp_path):
    args = argparse.Namespace(
        port=None, model=None, enforce_eager=False, server_args="--log-stats-interval 5"
    )
    command = serving.Server(args, tmp_path).command
    # Its own flag first: the server's argparse takes the last one given.
    assert command[-4:] == ["--log-stats-interval", "1.0", "--log-stats-interval", "5"]


def test_each_sweep_row_reads_the_engine_lines_logged_during_it(fake, tmp_path, monkeypatch):
    monkeypatch.setattr(serving_report, "STATS_INTERVAL_S", 0.0)  # a line covers [start, end] only
    log = tmp_path / "server.log"
    stop = threading.Event()

    def server_logging() -> None:  # a line every 50 ms, as a busy engine would each second
        with log.open("a") as f:
            while not stop.wait(0.05):
                f.write(stats_line(datetime.now(), 100, 10, 10) + "\n")
                f.flush()

    writer = threading.Thread(target=server_logging)
    writer.start()
    args = serving.build_parser().parse_args(
        ["--rates", "40", "--seconds-per-rate", "0.5", "--min-requests", "4",
         "--max-requests", "8", "--input-len", "4", "--output-len", "4", "--concurrency", "2"]
    )  # fmt: skip
    try:
        base = ["--base-url", fake.base_url, "--no-progress", "--workers", "1"]
        rows = serving.sweep(args, base, tmp_path, 1000.0, log)
    finally:
        stop.set()
        writer.join()
    assert [r["rate"] for r in rows] == ["40", "inf", "c2"]
    for row in rows:
        assert row["engine"]["lines"] >= 1
        assert row["engine"]["host_working_pct"] == pytest.approx(80.0, abs=1)
