"""What a serving sweep reports (benchmarks/serving.py): each load test's figures against
the offline ceiling, the engine's stats lines logged during the run, a table, a plot."""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path

STATS_INTERVAL_S = 1.0  # the started server's engine stats line, read back per run
# "2026-11-23 18:25:45,224 INFO pagoda.server (engine process): engine: 368 steps/s
# (graph 84%, ...), ...; host: working 99%, waiting on the device 1%, idle 0%"
STATS_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*engine: (\d+) steps/s \(graph (\d+)%.*"
    r"host: working (\d+)%, waiting on the device (\d+)%, idle (\d+)%"
)


def pick(stats: dict | None, key: str) -> float | None:
    return None if stats is None else stats[key]


def summarize(result: dict, offline_tok_s: float | None) -> dict:
    m = result["metrics"]
    return {
        "argv": result["argv"],
        "completed": m["completed"],
        "failed": m["failed"],
        "errors": m["errors"],
        "request_throughput": m["request_throughput"],
        "output_throughput": m["output_throughput"],
        "total_token_throughput": m["total_token_throughput"],
        "output_vs_offline": m["output_throughput"] / offline_tok_s if offline_tok_s else None,
        "client_busy_max": max(result.get("client_busy") or [0.0]),
        **{
            f"{name}_{q}_ms": pick(m[name], q)
            for name in ("ttft", "itl", "tpot", "e2el")
            for q in ("mean", "p50", "p90", "p99")
        },
    }


def engine_window(log_path: Path | None, start: float, end: float) -> dict | None:
    """The engine's stats lines logged for [start, end] (epoch seconds), averaged:
    None without a log of ours or a line in the window."""
    if log_path is None or not log_path.exists():
        return None
    rows = []
    for line in log_path.read_text(errors="replace").splitlines():
        m = STATS_LINE.match(line)
        if m is None:
            continue
        t = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()  # local, as logged
        # A line covers the interval that ends at it: most of it must lie in the run.
        if start + STATS_INTERVAL_S / 2 <= t <= end + STATS_INTERVAL_S / 2:
            rows.append([float(x) for x in m.groups()[1:]])
    if not rows:
        return None
    keys = ["steps_per_s", "graph_pct", "host_working_pct", "host_waiting_pct", "host_idle_pct"]
    return {"lines": len(rows)} | {
        k: round(sum(r[i] for r in rows) / len(rows), 1) for i, k in enumerate(keys)
    }


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def print_sweep(rows: list[dict], offline: float | None) -> None:
    print(f"\nRate sweep (offline engine: {fmt(offline)} tok/s)")
    head = ("rate", "req/s", "out tok/s", "vs offl", "TTFT p50", "TTFT p99", "ITL p50",
            "ITL p99", "TPOT p50", "failed", "eng host")  # fmt: skip
    print("".join(f"{h:>10}" for h in head))
    for r in rows:
        cells = (
            r["rate"], fmt(r["request_throughput"], ".2f"), fmt(r["output_throughput"]),
            "-" if r["output_vs_offline"] is None else f"{100 * r['output_vs_offline']:.0f}%",
            fmt(r["ttft_p50_ms"]), fmt(r["ttft_p99_ms"]), fmt(r["itl_p50_ms"]),
            fmt(r["itl_p99_ms"]), fmt(r["tpot_p50_ms"]), r["failed"],
            "-" if not r.get("engine") else f"{r['engine']['host_working_pct']:.0f}%",
        )  # fmt: skip
        print("".join(f"{c:>10}" for c in cells))
    if any(r.get("engine") for r in rows):
        print("eng host: the share of the run the engine's host side was working (its stats line)")


def plot_sweep(rows: list[dict], offline: float | None, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    finite = [r for r in rows if "concurrency" not in r and r["rate"] != "inf"]
    if not finite:
        return False
    rates = [float(r["rate"]) for r in finite]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.plot(rates, [r["output_throughput"] for r in finite], "o-", label="output tok/s")
    for r in rows:
        if r["rate"] == "inf":
            ax1.axhline(r["output_throughput"], color="C1", ls="--", label="all at once")
        elif "concurrency" in r:
            label = f"{r['concurrency']} in flight"
            ax1.axhline(r["output_throughput"], color="C3", ls="-.", label=label)
    if offline:
        ax1.axhline(offline, color="C2", ls=":", label="offline engine")
    ax1.set(xscale="log", xlabel="request rate (req/s)", ylabel="tokens/s", title="Throughput")
    for name in ("ttft", "itl"):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax2.plot(rates, [r[f"{name}_{q}_ms"] for r in finite], style, label=f"{name} {q}")
    ax2.set(xscale="log", yscale="log", xlabel="request rate (req/s)", ylabel="ms")
    ax2.set_title("Latency")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
