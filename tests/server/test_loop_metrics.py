"""The lock-free loop metrics expose what prometheus_client's own would."""

from __future__ import annotations

from prometheus_client import generate_latest

from server.metrics import Metrics


def test_histogram_and_counters_expose_prometheus_text():
    m = Metrics()
    for value in (0.001, 0.003, 0.2, 100.0):  # 0.001 sits on a bound: le is inclusive
        m.itl.observe(value)
    m.generation_tokens.inc(5)
    m.request_success.inc(2, "length")
    m.request_success.inc(1, "abort")
    text = generate_latest(m.registry).decode()
    assert 'pagoda:inter_token_latency_seconds_bucket{le="0.001"} 1.0' in text
    assert 'pagoda:inter_token_latency_seconds_bucket{le="0.005"} 2.0' in text
    assert 'pagoda:inter_token_latency_seconds_bucket{le="2.5"} 3.0' in text
    assert 'pagoda:inter_token_latency_seconds_bucket{le="+Inf"} 4.0' in text
    assert "pagoda:inter_token_latency_seconds_count 4.0" in text
    assert "pagoda:generation_tokens_total 5.0" in text
    assert "pagoda:prompt_tokens_total 0.0" in text
    assert 'pagoda:request_success_total{finished_reason="length"} 2.0' in text
    assert 'pagoda:request_success_total{finished_reason="abort"} 1.0' in text
