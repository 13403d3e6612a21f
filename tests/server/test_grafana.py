"""docker/: the Grafana dashboard is valid JSON whose PromQL names only metrics that
/metrics exports, and compose wires Prometheus to Pagoda and Grafana to both."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

DOCKER = Path(__file__).resolve().parents[2] / "docker"

_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool"}
_PROMQL_WORDS |= {"and", "or", "unless", "offset", "inf", "nan"}


def promql_metric_names(expr: str) -> list[str]:
    """The metric names an expression selects (not its functions, labels or variables)."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", bare)  # label matchers, ranges
    bare = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", bare)
    names = []
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", bare):
        before, after = bare[: m.start()], bare[m.end() :].lstrip()
        if before.endswith(("$", ".")) or before[-1:].isdigit() or after.startswith("("):
            continue  # a variable, part of a number, a function
        if m.group().lower() not in _PROMQL_WORDS:
            names.append(m.group())
    return names


def test_promql_metric_names():
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(pagoda:x_bucket{instance=~"$i"}'
        "[$__rate_interval]))) / on (job) sum(up) * 1e3"
    )
    assert promql_metric_names(expr) == ["pagoda:x_bucket", "up"]


def grafana_panels(dashboard: dict) -> list[dict]:
    panels = []
    for panel in dashboard["panels"]:
        panels += [panel, *panel.get("panels", [])]  # rows hold panels of their own
    return panels


def test_grafana_dashboard_asks_only_for_exported_metrics(client, model_name):
    # A request first, so that every labelled series has a sample.
    client.post("/v1/completions", json={"model": model_name, "prompt": "Hi", "max_tokens": 2})
    lines = client.get("/metrics").text.splitlines()
    exported = {line.split("{")[0].split(" ")[0] for line in lines if not line.startswith("#")}
    exported.discard("")
    dashboard = json.loads((DOCKER / "grafana" / "pagoda.json").read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    # label_values(metric, label): the metric is PromQL, the label is not.
    (selector,) = re.fullmatch(
        r"label_values\((.+), *\w+\)", variables["instance"]["query"]["query"]
    ).groups()
    exprs = [selector]

    panels = grafana_panels(dashboard)
    assert len({p["id"] for p in panels}) == len(panels), "panel ids are unique"
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        assert {"x", "y", "w", "h"} <= panel["gridPos"].keys()
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        exprs += [target["expr"] for target in panel["targets"]]
    asked = set()
    for expr in exprs:
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
        names = promql_metric_names(expr)
        assert names, expr
        asked.update(names)
    assert asked <= exported, asked - exported
    # Everything the live page plots, Grafana plots too.
    for name in ("generation_tokens_total", "num_requests_running", "num_requests_waiting",
                 "kv_cache_usage_perc", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "num_preemptions_total",
                 "prefix_cache_hits_total", "request_success_total"):  # fmt: skip
        assert f"pagoda:{name}" in asked, name


def test_compose_wires_prometheus_and_grafana_to_pagoda():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    mounts = {}
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            source, target = volume.split(":")[:2]
            if source.startswith("./"):
                assert (DOCKER / source).exists(), volume
                mounts[target] = DOCKER / source
            else:
                assert source in compose["volumes"], volume

    prometheus = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    (job,) = prometheus["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["pagoda:8000"]  # the service, its port
    assert "8000" in services["pagoda"]["ports"][0]

    provisioning = mounts["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())[
        "datasources"
    ]
    assert source["type"] == "prometheus" and source["isDefault"]
    assert source["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "pagoda.yaml").read_text())[
        "providers"
    ]
    dashboards = Path(provider["options"]["path"])
    assert mounts[str(dashboards / "pagoda.json")] == DOCKER / "grafana" / "pagoda.json"
