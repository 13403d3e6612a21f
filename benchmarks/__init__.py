"""Benchmarks: offline throughput and kernel timings, results as JSON under results/."""
