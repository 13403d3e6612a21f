"""Human-readable output of a load test: the results table and the optional plots."""

from __future__ import annotations

from pathlib import Path

from clients.metrics import BenchmarkMetrics, RequestRecord, Stats, throughput_timeline

WIDTH = 72


def _row(label: str, value: object) -> str:
    return f"{label:<44}{value:>{WIDTH - 44}}"


def _stats_row(name: str, stats: Stats | None) -> str:
    if stats is None:
        return f"{name:<6}" + "".join(f"{'-':>9}" for _ in range(7)) + f"{0:>9}"
    values = (stats.mean, stats.std, stats.p50, stats.p90, stats.p95, stats.p99, stats.max)
    return f"{name:<6}" + "".join(f"{v:>9.2f}" for v in values) + f"{stats.count:>9}"


def format_table(metrics: BenchmarkMetrics, notes: list[str] | None = None) -> str:
    m = metrics
    lines = [
        " Load test result ".center(WIDTH, "="),
        _row("Successful requests:", m.completed),
        _row("Failed requests:", m.failed),
        _row("Benchmark duration (s):", f"{m.duration_s:.2f}"),
        _row("Total input tokens:", m.total_input_tokens),
        _row("Total generated tokens:", m.total_output_tokens),
        _row("Request throughput (req/s):", f"{m.request_throughput:.2f}"),
        _row("Output token throughput (tok/s):", f"{m.output_throughput:.2f}"),
        _row("Total token throughput (tok/s):", f"{m.total_token_throughput:.2f}"),
    ]
    if m.goodput is not None:
        slos = " ".join(f"{k}:{v:g}" for k, v in m.slos_ms.items())
        lines.append(_row(f"Request goodput (req/s) [{slos} ms]:", f"{m.goodput:.2f}"))
    header = ["mean", "std", "p50", "p90", "p95", "p99", "max", "n"]
    lines += [
        " Latency (ms) ".center(WIDTH, "-"),
        f"{'':<6}" + "".join(f"{h:>9}" for h in header),
        _stats_row("TTFT", m.ttft),
        _stats_row("TPOT", m.tpot),
        _stats_row("ITL", m.itl),
        _stats_row("E2EL", m.e2el),
    ]
    if m.failed:
        lines.append(" Errors ".center(WIDTH, "-"))
        lines += [f"{kind}: {count}" for kind, count in sorted(m.errors.items())]
        for message, count in m.error_messages[:5]:
            lines.append(f"  {count} x {message[: WIDTH * 2]}")
        if len(m.error_messages) > 5:
            lines.append(
                f"  ... {len(m.error_messages) - 5} more distinct messages in the result file"
            )
    for note in notes or []:
        lines.append(f"note: {note}")
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def write_plots(records: list[RequestRecord], t0: float, plot_dir: Path) -> list[Path] | None:
    """Latency CDFs and output tokens/s over time as PNGs; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on a benchmark box
        import matplotlib.pyplot as plt
    except ImportError:
        return None

    plot_dir.mkdir(parents=True, exist_ok=True)
    done = [r for r in records if r.ok]
    series = {
        "TTFT": [r.ttft for r in done if r.ttft is not None],
        "ITL": [gap for r in done for gap in r.itls],
        "TPOT": [r.tpot for r in done if r.tpot is not None],
        "E2E latency": [r.latency for r in done if r.latency is not None],
    }
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, seconds) in zip(axes.flat, series.items(), strict=True):
        ms = sorted(s * 1000.0 for s in seconds)
        if ms:
            ax.plot(ms, [(i + 1) / len(ms) for i in range(len(ms))], drawstyle="steps-post")
        ax.set_title(f"{name} CDF (n={len(ms)})")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction ≤ x")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    cdf_path = plot_dir / "latency_cdf.png"
    fig.savefig(cdf_path, dpi=110)
    plt.close(fig)

    # 1 s bins, finer for short runs so the plot still has a shape.
    span = max((t for r in done for t in r.chunk_times), default=t0) - t0
    bin_s = 1.0 if span >= 20 else max(span / 20, 0.01)
    starts, rates = throughput_timeline(records, t0, bin_s=bin_s)
    fig, ax = plt.subplots(figsize=(10, 4))
    if starts:  # close the last bin so it is drawn with its width
        ax.step([*starts, starts[-1] + bin_s], [*rates, rates[-1]], where="post")
    ax.set_title(f"Output tokens/s over time ({bin_s:.3g} s bins)")
    ax.set_xlabel("seconds since benchmark start")
    ax.set_ylabel("tokens/s")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tput_path = plot_dir / "throughput.png"
    fig.savefig(tput_path, dpi=110)
    plt.close(fig)
    return [cdf_path, tput_path]
