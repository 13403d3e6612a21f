"""Metric math on synthetic records whose timestamps are known exactly."""

import pytest

from clients.metrics import (
    RequestRecord,
    Stats,
    benchmark_span,
    compute_metrics,
    meets_slos,
    parse_goodput,
    throughput_timeline,
)
from clients.report import format_table

approx = pytest.approx


def records() -> list[RequestRecord]:
    return [
        # ttft 0.1, itls 0.05 0.1 0.05, e2e 0.32, tpot (0.32-0.1)/3
        RequestRecord(0, 0.0, [0.1, 0.15, 0.25, 0.30], 0.32, 10, 4),
        # one output token: no TPOT, TPOT counts as 0 for goodput
        RequestRecord(1, 1.0, [1.2], 1.21, 5, 1),
        # server packed 8 tokens into 2 chunks: TPOT uses usage's 8, ITL the chunk gap
        RequestRecord(2, 0.5, [0.9, 1.0], 1.1, 7, 8),
        RequestRecord(3, 0.2, [], 0.25, error="HTTP 400: bad", error_kind="http"),
        # failed after some chunks: its timestamps must not leak into latency stats
        RequestRecord(4, 0.3, [5.0, 9.0], 9.5, error="too slow", error_kind="timeout"),
        # no usage chunk: 3 output tokens counted from chunks, prompt tokens unknown
        RequestRecord(5, 1.9, [2.0, 2.1, 2.2], 2.25),
    ]


def test_per_request_definitions():
    r = records()
    assert r[0].ttft == approx(0.1)
    assert r[0].itls == approx([0.05, 0.1, 0.05])
    assert r[0].latency == approx(0.32)
    assert r[0].tpot == approx((0.32 - 0.1) / 3)
    assert r[1].tpot is None
    assert r[2].tpot == approx((0.6 - 0.4) / 7)
    assert r[5].output_tokens == 3 and not r[5].usage_reported
    assert r[3].ttft is None and not r[3].ok


def test_aggregates_and_throughput():
    m = compute_metrics(records(), duration_s=2.5)
    assert (m.completed, m.failed) == (4, 2)
    assert m.total_output_tokens == 4 + 1 + 8 + 3
    assert m.total_input_tokens == 10 + 5 + 7
    assert m.request_throughput == approx(4 / 2.5)
    assert m.output_throughput == approx(16 / 2.5)
    assert m.total_token_throughput == approx((16 + 22) / 2.5)
    assert m.usage_missing == 1
    assert m.goodput is None


def test_percentiles_interpolate_linearly_in_ms():
    m = compute_metrics(records(), duration_s=2.5)
    # TTFTs of the completed requests: 100, 200, 400, 100 ms -> sorted 100 100 200 400.
    assert m.ttft.count == 4
    assert m.ttft.mean == approx(200)
    assert m.ttft.p50 == approx(150)
    assert m.ttft.p90 == approx(200 + 0.7 * 200)  # rank 0.9 * 3 = 2.7
    assert m.ttft.p99 == approx(200 + 0.97 * 200)
    assert m.ttft.max == approx(400)
    assert m.ttft.std == approx((((100 - 200) ** 2 * 2 + 0 + 200**2) / 4) ** 0.5)
    # ITL pools every gap: 50 100 50 | 100 | 100 100
    assert m.itl.count == 6
    assert m.itl.mean == approx(500 / 6)
    assert m.itl.max == approx(100)
    # TPOT only for requests with > 1 output token: 0, 2, 5.
    assert m.tpot.count == 3
    assert m.tpot.mean == approx(1000 * ((0.22 / 3) + (0.2 / 7) + (0.25 / 2)) / 3)
    assert m.e2el.p50 == approx(1000 * (0.32 + 0.35) / 2)  # sorted 210 320 350 600


def test_errors_counted_with_messages():
    m = compute_metrics(records(), duration_s=2.5)
    assert m.errors == {"http": 1, "timeout": 1}
    assert sorted(m.error_messages) == [("HTTP 400: bad", 1), ("too slow", 1)]
    table = format_table(m, ["a note"])
    assert "Failed requests:" in table and "timeout: 1" in table
    assert "HTTP 400: bad" in table and "note: a note" in table


def test_goodput_slos():
    r = records()
    # TTFT <= 150 ms: requests 0 and 5.
    assert compute_metrics(r, 2.5, {"ttft": 150}).goodput == approx(2 / 2.5)
    # Adding TPOT <= 50 ms: request 0 (73 ms) and 5 (125 ms) fail.
    assert compute_metrics(r, 2.5, {"ttft": 150, "tpot": 50}).goodput == 0
    # A one-token request passes any TPOT target; the bound is inclusive.
    assert meets_slos(r[1], {"ttft": 200, "tpot": 0})
    assert not meets_slos(r[1], {"ttft": 199.9})
    assert compute_metrics(r, 2.5, {"e2el": 351}).goodput == approx(3 / 2.5)  # 210 320 350
    # A request that never produced text cannot meet a TTFT target.
    assert not meets_slos(RequestRecord(9, 0.0, [], 0.1, 2, 0), {"ttft": 1000})


def test_parse_goodput():
    assert parse_goodput(["ttft:200", "tpot:50.5", "e2el:1e4"]) == {
        "ttft": 200,
        "tpot": 50.5,
        "e2el": 10000,
    }
    assert parse_goodput(None) == {}
    for bad in ("ttft", "itl:5", "ttft:x", "ttft:-1"):
        with pytest.raises(ValueError):
            parse_goodput([bad])


def test_empty_and_all_failed():
    m = compute_metrics([], duration_s=0.0)
    assert m.completed == 0 and m.ttft is None and m.request_throughput == 0
    failed = [RequestRecord(0, 0.0, [], 1.0, error="refused", error_kind="connection")]
    m = compute_metrics(failed)
    assert m.failed == 1 and m.itl is None and m.errors == {"connection": 1}
    assert "-" in format_table(m)
    assert Stats.of([]) is None


def test_duration_defaults_to_record_span():
    assert benchmark_span(records()) == approx(9.5)  # includes the failed request
    assert compute_metrics(records()).duration_s == approx(9.5)


def test_throughput_timeline_spreads_usage_over_chunks():
    r = [
        RequestRecord(0, 0.0, [0.2, 0.7, 1.2], 1.3, 1, 6),  # 2 tokens per chunk
        RequestRecord(1, 0.0, [1.5], 1.6, 1, 1),
        RequestRecord(2, 0.0, [0.1], 0.2, error="x", error_kind="http"),
    ]
    starts, rates = throughput_timeline(r, t0=0.0, bin_s=1.0)
    assert starts == [0.0, 1.0]
    assert rates == approx([4.0, 3.0])
    assert throughput_timeline([], 0.0) == ([], [])


def test_record_json_round_trip_shifts_times():
    r = RequestRecord(3, 10.0, [10.5, 11.0], 11.5, 4, 2, requested_max_tokens=2, text="ab")
    d = r.to_json(t0=10.0)
    assert d["send_time"] == 0 and d["chunk_times"] == [0.5, 1.0] and d["end_time"] == 1.5
    back = RequestRecord.from_json(d)
    assert back.ttft == approx(r.ttft) and back.tpot == approx(r.tpot)
