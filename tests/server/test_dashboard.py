"""GET /dashboard in headless Chromium, against a server of two API processes
(--api-server-count 2) with --api-key, through a few seconds of load: the page must
draw non-empty series and show what /metrics says.

The screenshot lands in build/test-artifacts/ (or $PAGODA_TEST_ARTIFACTS).
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.browser import Browser, find_chromium
from tests.server.live_server import MAX_MODEL_LEN, ROOT, ServerProcess

ARTIFACTS = Path(os.environ.get("PAGODA_TEST_ARTIFACTS", ROOT / "build" / "test-artifacts"))
KEY = "dashboard-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny"
NUM_KV_BLOCKS = 24  # 384 tokens: eight streams of ~90 tokens need more, so some are preempted
MAX_NUM_SEQS = 8
# Longer than a block: every request after the first finds it in the prefix cache.
SHARED_PREFIX = (
    "Continuous batching keeps the GPU busy: new requests join while others decode. " * 2
)


# -- a server of two API processes -----------------------------------------------------


def start(model_dir: str, log: Path) -> ServerProcess:
    args = [
        "--model", model_dir, "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN),
        "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-num-seqs", str(MAX_NUM_SEQS),
        "--api-server-count", "2",
        "--api-key", KEY, "--served-model-name", MODEL, "--shutdown-timeout", "2",
    ]  # fmt: skip
    return ServerProcess(args, log)


@pytest.fixture(scope="module")
def server(tiny_gpt2_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    live = start(tiny_gpt2_dir, tmp_path_factory.mktemp("dashboard") / "serve.log")
    try:
        live.wait_ready()
        yield live
    finally:
        live.close()


# -- /metrics, read as the page reads it ----------------------------------------------


def scrape(base_url: str) -> dict[str, float]:
    """Every sample of /metrics, keyed by its series (`name{labels}`); a new connection,
    so any API process may answer (each answers for all)."""
    text = httpx.get(f"{base_url}/metrics", headers={"Connection": "close"}).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            samples[series] = float(value)
    return samples


def buckets(samples: dict[str, float], name: str) -> list[tuple[float, float]]:
    pattern = re.compile(re.escape(f"pagoda:{name}_bucket") + r'\{le="([^"]+)"\}')
    found = [(float(m.group(1)), v) for s, v in samples.items() if (m := pattern.fullmatch(s))]
    return sorted(found)


def histogram_quantile(q: float, cumulative: list[tuple[float, float]]) -> float | None:
    """Prometheus's histogram_quantile over cumulative (upper bound, count) buckets."""
    total = cumulative[-1][1]
    if total <= 0:
        return None
    rank = q * total
    b = next(i for i, (_, count) in enumerate(cumulative) if count >= rank)
    if math.isinf(cumulative[b][0]):
        return cumulative[b - 1][0]
    start, count = 0.0, cumulative[b][1]
    if b > 0:
        start, below = cumulative[b - 1]
        count, rank = count - below, rank - below
    return start + (cumulative[b][0] - start) * rank / count


def window_quantile_ms(q: float, first: dict, last: dict, name: str) -> float | None:
    a, b = buckets(first, name), buckets(last, name)
    increase = [(le, cb - ca) for (le, cb), (_, ca) in zip(b, a, strict=True)]
    value = histogram_quantile(q, increase)
    return None if value is None else value * 1000


# -- load ----------------------------------------------------------------------------


def stream_completion(base_url: str, prompt: str, max_tokens: int) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    # A new connection per request, so the requests spread over both API processes.
    with (
        httpx.Client(base_url=base_url, headers=AUTH | {"Connection": "close"}, timeout=60) as c,
        c.stream("POST", "/v1/completions", json=body | {"stream": True}) as r,
    ):
        assert r.status_code == 200, r.read()
        for _ in r.iter_lines():
            pass


def abandon_stream(base_url: str) -> None:
    """A client that leaves after the first chunk: the server aborts its request."""
    body = {"model": MODEL, "prompt": "Leave early", "max_tokens": 240, "ignore_eos": True}
    with httpx.stream(
        "POST", f"{base_url}/v1/completions", json=body | {"stream": True}, headers=AUTH
    ) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data: "))


def drive_load(base_url: str, seconds: float) -> None:
    """MAX_NUM_SEQS clients in closed loops over prompts sharing a prefix, for `seconds`."""
    abandon_stream(base_url)
    deadline = time.monotonic() + seconds
    errors: list[BaseException] = []

    def client(i: int) -> None:
        n = 0
        try:
            while time.monotonic() < deadline:
                stream_completion(base_url, f"{SHARED_PREFIX}Request {i}.{n}:", 40)
                n += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(MAX_NUM_SEQS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def settle(base_url: str, timeout: float = 10) -> None:
    """Wait until two scrapes in a row agree (the engine's last stats have landed)."""
    deadline = time.monotonic() + timeout
    previous = scrape(base_url)
    while time.monotonic() < deadline:
        time.sleep(0.1)
        current = scrape(base_url)
        if current == previous:
            return
        previous = current
    raise AssertionError("/metrics kept changing after the load ended")


# -- the page in Chromium --------------------------------------------------------------

READ_PAGE = """(() => {
    const tiles = {}, series = {}, header = {};
    for (const node of document.querySelectorAll("[data-tile] .value"))
        tiles[node.parentNode.dataset.tile] = node.dataset.value === "" ? null : Number(node.dataset.value);
    for (const path of document.querySelectorAll("path[data-series]"))
        series[path.dataset.series] = { points: JSON.parse(path.dataset.points), d: path.getAttribute("d") };
    for (const dd of document.querySelectorAll("#config dd")) header[dd.dataset.field] = dd.textContent;
    header.model = document.getElementById("model").textContent;
    return { tiles, series, header, state: document.body.dataset.state };
})()"""


def test_page_and_info_need_the_key_only_for_data(server):
    page = httpx.get(f"{server.base_url}/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<script>" in page.text
    assert not re.search(r"\b(src|href)\s*=|@import|url\(", page.text), "it loads nothing else"
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(f"{server.base_url}/dashboard/info", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    info = httpx.get(f"{server.base_url}/dashboard/info", headers=AUTH).json()
    assert info["model"] == MODEL and info["dtype"] == "float32" and info["device"] == "cpu"
    assert info["num_kv_blocks"] == NUM_KV_BLOCKS and info["max_num_seqs"] == MAX_NUM_SEQS
    assert info["api_server_count"] == 2 and info["tensor_parallel_size"] == 1
    assert info["uptime_s"] > 0


def test_info_without_api_key_in_the_engine_thread_layout(client, model_name):
    info = client.get("/dashboard/info").json()
    assert info["model"] == model_name and info["api_server_count"] == 1
    assert info["num_kv_blocks"] == 1024 and info["block_size"] == 16


@pytest.mark.skipif(find_chromium() is None, reason="needs chromium (apt-get install chromium)")
def test_dashboard_in_chromium_shows_what_metrics_says(server, tmp_path):
    browser = Browser(find_chromium(), tmp_path / "profile", tmp_path / "chromium.log")
    try:
        page = browser.new_page()
        page.navigate(f"{server.base_url}/dashboard")
        assert page.wait_for("document.body.dataset.state === 'need-key'") is True
        page.evaluate(
            f"document.getElementById('key-input').value = {json.dumps(KEY)};"
            "document.getElementById('key-form').requestSubmit()"
        )
        # Two polls before any load: the page's first sample is this scrape, and its first
        # point (a rate between its first two samples) is zero.
        page.wait_for("document.body.dataset.state === 'live' && +document.body.dataset.polls >= 2")
        first = scrape(server.base_url)

        drive_load(server.base_url, seconds=3.0)
        settle(server.base_url)
        # Two more polls: the second one began once /metrics had stopped changing.
        polls = page.evaluate("+document.body.dataset.polls")
        page.wait_for(f"+document.body.dataset.polls >= {polls + 2}")
        shown = page.evaluate(READ_PAGE)
        last = scrape(server.base_url)
        page.screenshot(ARTIFACTS / "dashboard.png")
    finally:
        browser.close()

    assert shown["state"] == "live"
    header = shown["header"]
    assert header["model"] == MODEL
    assert (header["dtype"], header["max_num_seqs"], header["block size"]) == ("float32", "8", "16")
    assert (header["KV blocks"], header["tensor parallel"], header["API processes"]) == (
        str(NUM_KV_BLOCKS), "1", "2",
    )  # fmt: skip

    # Every number on the page is what /metrics says (the server is idle again).
    def increase(series: str) -> float:
        return last.get(series, 0.0) - first.get(series, 0.0)

    reasons = 'pagoda:request_success_total{finished_reason="%s"}'
    expected = {
        "running": last["pagoda:num_requests_running"],
        "waiting": last["pagoda:num_requests_waiting"],
        "kv_usage": 100 * last["pagoda:kv_cache_usage_perc"],
        "output_tokens": increase("pagoda:generation_tokens_total"),
        "finished": increase(reasons % "stop") + increase(reasons % "length"),
        "aborted": increase(reasons % "abort"),
        "preemptions": increase("pagoda:num_preemptions_total"),
        "prefix_hit_rate": 100
        * increase("pagoda:prefix_cache_hits_total")
        / increase("pagoda:prefix_cache_queries_total"),
        "tokens_per_s": 0.0,
    }
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        short = "ttft" if name.startswith("time") else "itl"
        for q in (0.5, 0.99):
            expected[f"{short}_p{round(q * 100)}"] = window_quantile_ms(q, first, last, name)
    assert shown["tiles"] == pytest.approx(expected, rel=1e-9)
    # The load did what it was meant to, so the comparisons above mean something.
    assert expected["output_tokens"] >= MAX_NUM_SEQS * 40 and expected["finished"] >= MAX_NUM_SEQS
    assert expected["aborted"] >= 1 and expected["preemptions"] >= 1
    assert expected["prefix_hit_rate"] > 0

    # Every series was drawn, and the charts agree with the counters.
    series = shown["series"]
    assert len(series) == 12
    for name, s in series.items():
        assert len(s["points"]) >= 4, name
        assert s["d"].startswith("M") and "L" in s["d"], name
    for name in ("tokens_per_s", "running", "kv_usage", "ttft_p99", "itl_p50", "finished_per_s"):
        assert any(v for _, v in series[name]["points"]), name
    assert any(v for _, v in series["preemptions_per_s"]["points"])
    points = series["tokens_per_s"]["points"]
    assert points[0][1] == 0
    drawn = sum(v * (t - t0) for (t0, _), (t, v) in zip(points, points[1:], strict=False))
    assert drawn == pytest.approx(expected["output_tokens"], rel=1e-6)

    png = (ARTIFACTS / "dashboard.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000
