"""What a decode step must cost: the bytes it reads (the weights it uses, its batch's KV)
at the device's measured copy bandwidth, and each measured step against that floor."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from engine import LLM


@dataclass
class DecodeStep:
    seconds: float  # host time of the engine step that launched it
    batch: int
    context: int  # the batch's tokens in the KV cache, the new ones included


def copy_bandwidth() -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus written."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (time.perf_counter() - start)


def decode_floor_ms(llm: LLM, batch: int, mean_context: float, bandwidth: float) -> float:
    """The fewest bytes a decode step must read, at `bandwidth`: each weight it uses
    once, each sequence's KV once, and its recurrent states read and written once."""
    kv_bytes = batch * mean_context * kv_bytes_per_token(llm)
    fixed = weight_bytes(llm, batch) + batch * state_bytes_per_seq(llm)
    return 1e3 * (fixed + kv_bytes) / bandwidth


def weight_bytes(llm: LLM, batch: int) -> float:
    """The weights a decode step of `batch` sequences reads. Embedding tables are gathered
    by row, so they are left out; of an MoE layer's experts, the share a batch hits under
    uniform top-k routing, 1 - (1 - k/E)^batch."""
    from engine.models.experts import FusedMoE

    total = 0.0
    for module in llm.engine.model.modules():
        if isinstance(module, torch.nn.Embedding):
            continue
        # Buffers too: an FP8 projection keeps its weight and scales as buffers.
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, param in tensors:
            used = 1.0
            if isinstance(module, FusedMoE) and name in ("w13", "w2"):
                used = 1 - (1 - module.top_k / param.shape[0]) ** batch
            total += used * param.numel() * param.element_size()
    return total


def state_bytes_per_seq(llm: LLM) -> float:
    """A decode step's traffic per sequence to its recurrent layers' states (Qwen 3.5's
    Gated DeltaNet): each read and written once. 0 for a model without them."""
    from engine.models.layers import RecurrentLayer

    total = 0.0
    for module in llm.engine.model.modules():
        if isinstance(module, RecurrentLayer):
            for name in module.state_shapes():
                state = getattr(module, name)
                total += 2 * state[0].numel() * state.element_size()
    return total


def kv_bytes_per_token(llm: LLM) -> float:
    runner = llm.engine.runner
    return runner.bytes_per_block() / runner.block_size


def decode_vs_floor(llm: LLM, steps: list[DecodeStep], bandwidth: float) -> dict:
    """Each decode step's time against its own floor (its batch's weights and KV at the
    copy bandwidth): the median ratio, and the ratio of the sums (the run's decode time
    against the least it could have been)."""
    if not steps:
        return {"steps": 0}
    weights = {b: weight_bytes(llm, b) for b in {s.batch for s in steps}}
    per_token = kv_bytes_per_token(llm)
    state = state_bytes_per_seq(llm)
    floors = [
        (weights[s.batch] + s.batch * state + s.context * per_token) / bandwidth for s in steps
    ]
    times = [s.seconds for s in steps]
    return {
        "steps": len(steps),
        "batch_p50": statistics.median(s.batch for s in steps),
        "step_ms_p50": 1e3 * statistics.median(times),
        "floor_ms_p50": 1e3 * statistics.median(floors),
        "ratio_p50": statistics.median(t / f for t, f in zip(times, floors)),
        "ratio_total": sum(times) / sum(floors),
    }
