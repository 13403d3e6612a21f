"""The load test end to end against the fake streaming server in conftest.py."""

import json
import math
import os
import socket
import subprocess
import sys
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace

import pytest

from clients import loadtest
from clients.arrivals import arrival_gaps
from clients.connections import Connections
from clients.metrics import RequestRecord, compute_metrics
from clients.workload import RandomWorkload

approx = pytest.approx
ROOT = Path(__file__).resolve().parents[2]


def run(fake, tmp_path: Path, *args: str) -> tuple[int, dict]:
    result_file = tmp_path / "result.json"
    argv = ["--base-url", fake.base_url, "--no-progress", "--result-file", str(result_file)]
    rc = loadtest.main([*argv, *args])
    return rc, json.loads(result_file.read_text())


def assert_close(got, want) -> None:
    """Nested JSON equality with float tolerance (pytest.approx does not nest)."""
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        for key in want:
            assert_close(got[key], want[key])
    elif isinstance(want, list):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_close(g, w)
    elif isinstance(want, float):
        assert got == approx(want)
    else:
        assert got == want


def records_of(result: dict) -> list[RequestRecord]:
    return [RequestRecord.from_json(d) for d in result["records"]]


def test_reported_metrics_match_raw_timestamps(fake, tmp_path, capsys):
    fake.delay_s = 0.01
    rc, result = run(
        fake, tmp_path, "--concurrency", "4", "--num-requests", "8", "--max-tokens", "6",
        "--ignore-eos", "--goodput", "ttft:5000",
    )  # fmt: skip
    assert rc == 0
    assert "Load test result" in capsys.readouterr().out
    records = records_of(result)
    assert len(records) == 8 and all(r.ok for r in records)
    for r in records:
        assert r.completion_tokens == 6 and r.prompt_tokens == 3
        assert len(r.chunk_times) == 6 and r.text == " tok" * 6
        assert r.send_time < r.chunk_times[0] <= r.chunk_times[-1] <= r.end_time
        # The server sleeps before every token, so the first cannot come sooner.
        assert r.ttft >= 0.009
    # Every aggregate is reproducible from the raw records and the duration.
    m = result["metrics"]
    again = compute_metrics(records, m["duration_s"], {"ttft": 5000}).to_json()
    assert_close(again, m)
    ttfts = sorted(1000 * (r.chunk_times[0] - r.send_time) for r in records)
    assert m["ttft"]["max"] == approx(ttfts[-1])
    assert m["ttft"]["p50"] == approx((ttfts[3] + ttfts[4]) / 2)
    gaps = [b - a for r in records for a, b in pairwise(r.chunk_times)]
    assert m["itl"]["count"] == 8 * 5
    assert m["itl"]["mean"] == approx(1000 * sum(gaps) / len(gaps))
    assert m["itl"]["mean"] >= 8.0  # about the server's 10 ms spacing
    assert m["total_output_tokens"] == 48
    assert m["output_throughput"] == approx(48 / m["duration_s"])
    assert m["goodput"] == approx(8 / m["duration_s"])
    assert m["failed"] == 0 and result["notes"] == []
    # What went over the wire.
    assert len(fake.bodies) == 8
    body = fake.bodies[0]
    assert body["model"] == "fake-model"  # the first of GET /v1/models
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 6


def test_chat_role_chunk_is_not_content(fake, tmp_path):
    rc, result = run(
        fake, tmp_path, "--endpoint", "/v1/chat/completions", "--burst",
        "--num-requests", "3", "--max-tokens", "4", "--prompt", "hi",
    )  # fmt: skip
    assert rc == 0
    assert fake.bodies[0]["messages"] == [{"role": "user", "content": "hi"}]
    assert "ignore_eos" not in fake.bodies[0]
    for r in records_of(result):
        assert len(r.chunk_times) == 4 and r.completion_tokens == 4
        assert r.ttft >= 0.004


def test_errors_are_counted_and_kept(fake, tmp_path, capsys):
    dataset = tmp_path / "prompts.jsonl"
    prompts = ["fine", "[http-error]", "[stream-error]", "[no-done]", "[slow]", "fine too"]
    dataset.write_text("".join(json.dumps({"prompt": p, "max_tokens": 5}) + "\n" for p in prompts))
    rc, result = run(
        fake, tmp_path, "--dataset", str(dataset), "--num-requests", "6", "--timeout", "0.5",
    )  # fmt: skip
    assert rc == 0  # some requests succeeded, so the run measured something
    m = result["metrics"]
    assert (m["completed"], m["failed"]) == (2, 4)
    assert m["errors"] == {"http": 1, "stream": 1, "protocol": 1, "timeout": 1}
    by_index = {r.index: r for r in records_of(result)}
    assert by_index[1].error == "HTTP 400: prompt rejected"
    assert by_index[2].error == "engine exploded" and len(by_index[2].chunk_times) == 2
    assert "[DONE]" in by_index[3].error
    assert by_index[4].error_kind == "timeout" and by_index[4].latency < 1.5
    messages = {e["message"] for e in m["error_messages"]}
    assert "engine exploded" in messages and "HTTP 400: prompt rejected" in messages
    # Latency stats come from the two good requests only.
    assert m["e2el"]["count"] == 2 and m["itl"]["count"] == 2 * 4
    out = capsys.readouterr().out
    assert "Failed requests:" in out and "engine exploded" in out


def test_missing_usage_falls_back_to_chunks_and_says_so(fake, tmp_path):
    rc, result = run(
        fake, tmp_path, "--prompt", "[no-usage]", "--num-requests", "2", "--max-tokens", "3"
    )
    assert rc == 0
    assert result["metrics"]["usage_missing"] == 2
    assert result["metrics"]["total_output_tokens"] == 6
    assert any("no usage chunk" in n for n in result["notes"])


def test_open_loop_follows_the_seeded_schedule(fake, tmp_path):
    rc, result = run(
        fake, tmp_path, "--request-rate", "50", "--burstiness", "inf", "--num-requests", "6",
        "--max-tokens", "2",
    )  # fmt: skip
    assert rc == 0
    sends = [r.send_time for r in records_of(result)]
    # Request i goes at 20 ms x i, never early; late only by the host's hiccups (a busy
    # box delays one send, and the next goes on schedule: intervals alone would flake).
    offsets = [t - sends[0] for t in sends]
    for i, offset in enumerate(offsets):
        assert 0.02 * i - 0.002 <= offset <= 0.02 * i + 0.05, offsets
    # Poisson gaps are reproducible from the seed.
    gaps = arrival_gaps(10.0, 1.0, seed=3)
    first = [next(gaps) for _ in range(200)]
    again = arrival_gaps(10.0, 1.0, seed=3)
    assert first == [next(again) for _ in range(200)]
    assert sum(first) / 200 == approx(0.1, rel=0.25)
    assert next(arrival_gaps(math.inf, 1.0, 0)) == 0.0


def test_duration_and_warmup_bound_the_run(fake, tmp_path):
    rc, result = run(
        fake, tmp_path, "--concurrency", "2", "--num-requests", "0", "--duration", "0.3",
        "--max-tokens", "3", "--warmup", "2",
    )  # fmt: skip
    assert rc == 0
    records = records_of(result)
    assert len(result["warmup_records"]) == 2
    assert all(d["index"] < 0 for d in result["warmup_records"])
    assert 2 <= len(records) < 100
    # The loop decides before 0.3 s; send_time is stamped as the HTTP request starts, a
    # moment later (milliseconds on a busy 2-core CI box). Unbounded, sends would go on.
    assert all(r.send_time < 0.3 + 0.1 for r in records)
    assert sum(r.send_time >= 0.3 for r in records) <= 2  # at most one per worker
    assert len(fake.bodies) == len(records) + 2


def test_unreachable_server(tmp_path, capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    assert loadtest.main(["--base-url", base, "--no-progress"]) == 1
    assert "GET /v1/models" in capsys.readouterr().err
    result_file = tmp_path / "r.json"
    argv = ["--base-url", base, "--model", "m", "--num-requests", "3", "--no-progress"]
    assert loadtest.main([*argv, "--result-file", str(result_file)]) == 1
    assert json.loads(result_file.read_text())["metrics"]["errors"] == {"connection": 3}


def test_bad_arguments_exit_2():
    for argv in (["--goodput", "ttft"], ["--output-len-range", "1", "2"], ["--num-requests", "0"]):
        with pytest.raises(SystemExit) as e:
            loadtest.main([*argv, "--no-progress"])
        assert e.value.code == 2


def test_random_workload_is_seeded_and_in_range():
    w = RandomWorkload((4, 8), (2, 3), seed=7)
    specs = [w.request(i) for i in range(50)]
    assert specs == [RandomWorkload((4, 8), (2, 3), seed=7).request(i) for i in range(50)]
    assert all(4 <= len(s.prompt.split()) <= 8 and 2 <= s.max_tokens <= 3 for s in specs)
    assert all(s.ignore_eos for s in specs)
    assert w.request(0) != RandomWorkload((4, 8), (2, 3), seed=8).request(0)


def test_random_lengths_reach_max_tokens(fake, tmp_path):
    rc, result = run(
        fake, tmp_path, "--input-len-range", "3", "9", "--output-len-range", "2", "5",
        "--num-requests", "5", "--seed", "1",
    )  # fmt: skip
    assert rc == 0
    for r in records_of(result):
        assert r.completion_tokens == r.requested_max_tokens
    assert all(b["ignore_eos"] is True for b in fake.bodies)


def test_plots_or_one_line_note(fake, tmp_path, capsys):
    plot_dir = tmp_path / "plots"
    rc, _ = run(
        fake, tmp_path, "--num-requests", "4", "--max-tokens", "3", "--plot-dir", str(plot_dir)
    )
    assert rc == 0
    out = capsys.readouterr().out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "plots skipped: matplotlib is not installed" in out
    else:
        assert (plot_dir / "latency_cdf.png").stat().st_size > 0
        assert (plot_dir / "throughput.png").stat().st_size > 0


def test_openai_sdk_example_runs(fake):
    example = ROOT / "clients" / "examples" / "openai_sdk.py"
    proc = subprocess.run(
        [sys.executable, str(example), "--base-url", fake.base_url + "/v1", "--max-tokens", "3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("tok tok tok") >= 4  # completion + chat, streamed and not


def test_schedule_lag_is_reported():
    args = loadtest.parse_checked(["--request-rate", "50", "--burstiness", "inf"])
    late = [RequestRecord(i, 10.0 + t, [], 11.0, 1, 1) for i, t in enumerate([0, 0.02, 0.07])]
    assert loadtest.schedule_lag(args, late, t0=10.0) == approx(0.03)
    assert "behind the arrival schedule" in loadtest.result_notes(args, late, 10.0)[0]
    on_time = [RequestRecord(i, 10.0 + 0.02 * i, [], 11.0, 1, 1) for i in range(3)]
    assert loadtest.result_notes(args, on_time, 10.0) == []


def test_a_busy_client_is_reported():
    args = loadtest.parse_checked(["--concurrency", "2"])
    assert loadtest.result_notes(args, [], 0.0, client_busy=[0.4, 0.7]) == []
    [note] = loadtest.result_notes(args, [], 0.0, client_busy=[0.4, 0.97])
    assert "on the CPU 97% of the run" in note and "--workers" in note


def test_malformed_streams_fail_only_their_request(fake, tmp_path):
    dataset = tmp_path / "bad.jsonl"
    prompts = ["[bad-json]", "[bad-event] list", "[bad-event] dict", "fine"]
    dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    rc, result = run(fake, tmp_path, "--dataset", str(dataset), "--num-requests", "4")
    assert rc == 0
    m = result["metrics"]
    assert (m["completed"], m["errors"]) == (1, {"protocol": 3})
    errors = [r.error for r in records_of(result)[:3]]
    assert "bad JSON" in errors[0] and "not a JSON object" in errors[1]
    assert "TypeError" in errors[2]


def test_failed_warmup_is_noted():
    args = loadtest.parse_checked(["--concurrency", "1"])
    warmup = [RequestRecord(-1, 0.0, [], 0.1, error="HTTP 503: loading", error_kind="http")]
    assert loadtest.result_notes(args, [], 0.0, warmup) == [
        "1/1 warmup requests failed, e.g. HTTP 503: loading"
    ]


def test_curl_example_streams(fake):
    script = ROOT / "clients" / "examples" / "curl_stream.sh"
    env = {**os.environ, "BASE_URL": fake.base_url}
    proc = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, env=env, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    assert fake.bodies[-1]["stream"] is True and fake.bodies[-1]["model"] == "fake-model"
    assert proc.stdout.count("data: ") == 32 + 3 and "data: [DONE]" in proc.stdout


def test_client_processes_share_one_schedule(fake, tmp_path):
    """--workers: each process sends its share of the one seeded schedule, on one clock;
    the records come back whole and the metrics are computed from them as usual."""
    fake.delay_s = 0.002
    rc, result = run(
        fake, tmp_path, "--workers", "3", "--request-rate", "40", "--burstiness", "inf",
        "--num-requests", "9", "--max-tokens", "4", "--ignore-eos", "--input-len-range", "2", "4",
    )  # fmt: skip
    assert rc == 0
    records = records_of(result)
    assert [r.index for r in records] == list(range(9)) and all(r.ok for r in records)
    # Never before its time in the shared schedule; late only by scheduling noise, which
    # on a loaded 2-core box (three client processes, the server, another test file's
    # work beside this one) has reached 0.21 s.
    lateness = [r.send_time - i * 0.025 for i, r in enumerate(records)]
    assert all(-0.002 < late < 1.0 for late in lateness), lateness
    assert all(r.send_time < r.chunk_times[0] <= r.end_time for r in records)
    m = result["metrics"]
    assert_close(compute_metrics(records, m["duration_s"], {}).to_json(), m)
    assert m["total_output_tokens"] == 36
    # The same prompts as one process would send: the workload is seeded per index.
    want = [RandomWorkload((2, 4), (4, 4), seed=0).request(i).prompt for i in range(9)]
    assert sorted(b["prompt"] for b in fake.bodies) == sorted(want)

    # Closed loop: worker 1 gets index 1 only and exits long before worker 0 is done.
    fake.delay_s = 0.01
    rc, result = run(
        fake, tmp_path, "--workers", "2", "--concurrency", "2", "--num-requests", "3",
        "--max-tokens", "20", "--ignore-eos",
    )  # fmt: skip
    assert rc == 0
    assert [r.index for r in records_of(result)] == [0, 1, 2]
    # Each process's CPU share of the run: a fraction of it here (mostly waiting).
    assert len(result["client_busy"]) == 2 and all(0 < b < 1 for b in result["client_busy"])


@pytest.mark.parametrize("workers", ["1", "2"])
def test_warmup_opens_the_closed_loops_connections(fake, tmp_path, workers):
    """With --warmup, each client process opens the connections its closed loop holds
    before the clock starts: no measured request pays for a connection's setup."""
    fake.delay_s = 0.002
    rc, result = run(
        fake, tmp_path, "--workers", workers, "--concurrency", "6", "--num-requests", "18",
        "--warmup", "1", "--max-tokens", "3", "--ignore-eos",
    )  # fmt: skip
    assert rc == 0 and result["metrics"]["completed"] == 18
    opened = {port for method, port in fake.peers if method == "GET"}
    measured = [port for method, port in fake.peers if method == "POST"][1:]  # after the warmup's
    assert len(measured) == 18
    assert set(measured) <= opened, str(fake.peers)
    assert len(set(measured)) == 6  # the loop holds its 6 connections, each reused


def test_duration_ends_with_the_last_request(fake, tmp_path):
    """Throughputs divide by the time from the start to the last request's end (vLLM's
    duration), not to when the client processes have handed their records over."""
    fake.delay_s = 0.002
    rc, result = run(
        fake, tmp_path, "--workers", "2", "--concurrency", "4", "--num-requests", "12",
        "--max-tokens", "3", "--ignore-eos",
    )  # fmt: skip
    assert rc == 0
    records = records_of(result)  # times relative to the start
    m = result["metrics"]
    assert m["duration_s"] == approx(max(r.end_time for r in records), rel=1e-9)
    assert m["output_throughput"] == approx(36 / m["duration_s"])


def test_workers_beyond_concurrency_are_refused():
    with pytest.raises(SystemExit) as e:
        loadtest.main(["--workers", "3", "--concurrency", "2", "--no-progress"])
    assert e.value.code == 2


async def test_connections_are_reused_one_request_at_a_time(fake):
    args = SimpleNamespace(base_url=fake.base_url, api_key=None, timeout=10.0)
    async with Connections(args) as connections:
        connections.reserve(3)
        taken = [connections.take() for _ in range(3)]
        assert len(set(map(id, taken))) == 3 and not connections._idle
        fourth = connections.take()  # none idle: a new one
        assert fourth not in taken
        for client in taken:
            connections.give(client)
        assert connections.take() is taken[-1]  # the last given back goes out first
        connections.reserve(5)  # two idle already: three more
        assert len(connections._idle) == 5 and len(connections._all) == 7
        await connections.open(4)  # four at once: four connections
    assert len({port for method, port in fake.peers if method == "GET"}) == 4
