"""A decode step held at a full batch, and where its time goes: the helpers the
offline, profiling, host-step and FP8 benchmarks share."""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from engine import LLM, SamplingParams


def start_decoding(
    engine, batch: int, context: int, max_tokens: int, params: SamplingParams | None = None
) -> int:
    """Add `batch` greedy requests of `context` tokens ("p0", "p1", ...), final-only
    unless `params` says otherwise, and step until every one is running with an
    output token. Returns the steps that took.

    Each prompt is its own random tokens (seeded: the same each run), so an MoE
    model routes the sequences as a real batch would; one prompt repeated sends
    every sequence to the same experts.

    Prefill is chunked over several steps, so the first requests admitted decode
    while later ones wait: `max_tokens` must outlast the admission. A request that
    ends first raises, rather than leaving the loop to step an engine that can
    never hold the whole batch."""
    if batch > engine.config.max_num_seqs:
        raise ValueError(f"batch {batch} exceeds max_num_seqs {engine.config.max_num_seqs}")
    params = params or SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, final_only=True
    )
    rng = np.random.default_rng(0)
    for i in range(batch):
        engine.add_request(f"p{i}", rng.integers(1, engine.vocab_size, context).tolist(), params)
    scheduler = engine.scheduler
    num_steps = 0
    while (
        scheduler.waiting
        or len(scheduler.running) < batch
        or any(not r.output_token_ids for r in scheduler.running)
    ):
        outputs = engine.step()
        num_steps += 1
        if any(out.finished for out in outputs) or not engine.has_unfinished_requests():
            raise RuntimeError(
                f"a request finished {num_steps} steps in, before all {batch} were "
                f"decoding: max_tokens {max_tokens} does not outlast the admission"
            )
    return num_steps


def profile_decode_step(
    llm: LLM, batch: int, context: int, steps: int = 256, warmup: int = 16
) -> dict:
    """Where a decode step's time goes, at `batch` sequences of ~`context` tokens.

    Every timed step decodes the full batch: the requests ignore EOS and may run to
    max_model_len, timing starts once all are admitted and decoding, and it stops
    after a fixed number of steps, long before the first could finish (checked:
    nobody leaves the batch or is preempted inside a timed window).

    The real step is measured: the host schedules and launches step N, then reads
    step N-1's ids and builds its outputs while the GPU runs N. `wait` is the time
    the host sat blocked on the device; the rest is host work. It is timed over
    `steps` plain steps after `warmup` untimed ones: the mean, and the median and
    p90 of the steps. The same number of steps again, with the scheduler, the
    runner's launch and the sampler wrapped with timers (no syncs added), gives
    the phases; `other` is the rest of the step (reading ids, outputs). The timers
    add a little of their own, so the phases' sum runs above the plain host work.

    With CUDA graphs, `gpu_step` is the device's share alone: the bucket's graph
    and the argmax, replayed back to back with the batch at the timing pass's mean
    context. The graph's first node copies the step's staging buffer in (H2D) and
    its last the sampled ids out (D2H): `h2d`/`d2h` time those copies alone on the
    device. Requests are final-only, as in the throughput run."""
    engine = llm.engine
    runner = engine.runner
    max_tokens = engine.config.max_model_len - context
    admission_steps = start_decoding(engine, batch, context, max_tokens)
    # The first admitted has decoded through the admission; +2: the step in flight.
    lead = max(len(r.output_token_ids) for r in engine.scheduler.running)
    if lead + warmup + 2 * steps + 2 > max_tokens:
        raise ValueError(
            f"context {context} leaves {max_tokens - lead} tokens after the admission, "
            f"fewer than the {warmup + 2 * steps + 2} the timed steps need: "
            "lower steps or context, or raise max_model_len"
        )
    preemptions = engine.get_stats().num_preemptions
    for _ in range(warmup):
        engine.step()

    wait0 = runner.wait_s
    host: list[float] = []  # per step: its time less its wait
    start = last = time.perf_counter()
    for _ in range(steps):
        waited = runner.wait_s
        engine.step()
        now = time.perf_counter()
        host.append(now - last - (runner.wait_s - waited))
        last = now
    elapsed = time.perf_counter() - start
    _check_full_batch(engine, batch, preemptions)
    step_us = 1e6 * elapsed / steps
    wait_us = 1e6 * (runner.wait_s - wait0) / steps

    totals = dict.fromkeys(["schedule", "prepare_launch", "sample_launch"], 0.0)
    wrapped = [
        (engine.scheduler, "schedule", "schedule"),
        (runner, "execute", "prepare_launch"),
        (engine.sampler, "sample", "sample_launch"),
    ]
    for obj, attr, phase in wrapped:
        setattr(obj, attr, phase_timer(getattr(obj, attr), totals, phase, runner))
    wait0 = runner.wait_s
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    timed_host = time.perf_counter() - start - (runner.wait_s - wait0)
    for obj, attr, _ in wrapped:
        delattr(obj, attr)
    _check_full_batch(engine, batch, preemptions)
    _abort_all(engine, batch)
    totals["other"] = timed_host - sum(totals.values())
    phases = {k: 1e6 * v / steps for k, v in totals.items()}

    result = {
        "batch": batch,
        "context": context,
        "steps": steps,
        "admission_steps": admission_steps,
        "step_us": step_us,
        "host_work_us": step_us - wait_us,  # the mean: rare stalls (GC, the OS) count
        "host_work_p50_us": 1e6 * statistics.median(host),
        "host_work_p90_us": 1e6 * statistics.quantiles(host, n=10)[-1],
        "host_phases_us": phases,
        "wait_us": wait_us,
    }
    if engine.config.use_cuda_graphs:
        result |= _device_step(engine, batch, context + warmup + steps // 2, steps)
        result["gpu_idle_us"] = max(step_us - result["gpu_step_us"], 0.0)
    return result


def _device_step(engine, batch: int, context: int, replays: int) -> dict:
    """The decode graph's device time at `batch` x `context`, and its copies'. Reads
    the runner's graphs (engine/cuda_graphs.py) and staging buffers (engine/staging.py):
    replays use the last decode step's metadata, so a batch at `context` decodes first."""
    runner = engine.runner
    start_decoding(engine, batch, context, engine.config.max_model_len - context)
    bucket = runner.graphs.decode_bucket[batch]
    graph = runner.graphs.decode[bucket][runner.parity]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()  # the greedy argmax is inside it
    torch.cuda.synchronize()
    gpu_us = 1e6 * (time.perf_counter() - start) / replays
    staged, sampled = runner.staged, runner.sampled
    host_ids = sampled.hosts[0][:batch]
    h2d_us = _device_us(lambda: staged.staged.copy_(staged.hosts[0], non_blocking=True))
    d2h_us = _device_us(lambda: host_ids.copy_(sampled.device_rows[batch], non_blocking=True))
    _abort_all(engine, batch)
    return {
        "gpu_step_us": gpu_us,
        "h2d_us": h2d_us,  # inside gpu_step
        "h2d_bytes": staged.hosts[0].numel(),
        "d2h_us": d2h_us,  # inside gpu_step
    }


def _check_full_batch(engine, batch: int, preemptions: int) -> None:
    """A timed window counts only if the whole batch decoded through it."""
    stats = engine.get_stats()
    if stats.num_running != batch or stats.num_waiting or stats.num_preemptions != preemptions:
        raise RuntimeError(
            f"the batch changed inside a timed window: {stats.num_running} of {batch} running, "
            f"{stats.num_waiting} waiting, {stats.num_preemptions - preemptions} preempted"
        )


def _abort_all(engine, batch: int) -> None:
    for i in range(batch):
        engine.abort_request(f"p{i}")


def _device_us(fn, n: int = 32) -> float:
    """Device time of one call of fn (a copy), from events around n calls queued
    behind a sleep, so that no host launch gap lands between the events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000)  # ~1 ms of GPU time: the host queues everything first
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / n


def phase_timer(fn, totals: dict[str, float], phase: str, runner):
    """fn, adding its time minus any device wait inside it to totals[phase]."""

    def timed(*args, **kwargs):
        wait0, start = runner.wait_s, time.perf_counter()
        out = fn(*args, **kwargs)
        totals[phase] += time.perf_counter() - start - (runner.wait_s - wait0)
        return out

    return timed
