"""Piecewise CUDA graphs: a step with prefill tokens, replayed as graphs between attentions.

A decode-only step is one graph: its attention has a fixed shape. A step with
prefill chunks varies inside attention only (query lengths; max_query_len
sizes the kernel's grid); every other kernel depends on the token count
alone. So for token-count buckets the forward is captured as num_layers + 1
graphs, cut at each attention, and attention runs eagerly between them, as in
vLLM's piecewise graphs. Eagerly, a GPT-2 step launches ~150 kernels from
Python; piecewise, 13 graph replays and 12 attention launches.

Each layer's KV store stays inside its graph (it needs only slot_mapping, a
static buffer). The query leaves a graph through one static buffer and the
attention's output enters the next through another; both are shared by every
layer and bucket, since replays run one at a time, in order, on one stream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.models.layers import AttentionMetadata, PagedAttention


@dataclass
class Pieces:
    """One bucket's forward: graphs[i], then layers[i]'s attention, ..., graphs[-1]."""

    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    layers: list[PagedAttention] = field(default_factory=list)
    hidden: torch.Tensor | None = None  # [bucket, hidden], written by graphs[-1]


class PiecewiseGraphs:
    def __init__(self, attn_layers: list[PagedAttention], max_tokens: int, dtype, device) -> None:
        self.attn_layers = attn_layers
        layer = attn_layers[0]
        shape = (max_tokens, layer.num_heads, layer.head_dim)
        self.query = torch.zeros(shape, dtype=dtype, device=device)
        self.out = torch.zeros(shape, dtype=dtype, device=device)
        self.pool = torch.cuda.graph_pool_handle()
        self.buckets: dict[int, Pieces] = {}

    def bucket_for(self, num_tokens: int) -> int | None:
        fits = [b for b in self.buckets if b >= num_tokens]
        return min(fits) if fits else None

    def capture(self, bucket: int, forward: Callable[[], torch.Tensor]) -> None:
        """Capture forward() (the model on static inputs of `bucket` tokens) in pieces."""
        pieces = Pieces()

        def skip(layer: PagedAttention, query: torch.Tensor) -> torch.Tensor:
            n = query.shape[0]
            self.query[:n].copy_(query)
            return self.out[:n]

        def begin() -> None:
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.pool)
            pieces.graphs.append(graph)

        def split(layer: PagedAttention, query: torch.Tensor) -> torch.Tensor:
            n = query.shape[0]
            self.query[:n].copy_(query)
            pieces.graphs[-1].capture_end()
            pieces.layers.append(layer)
            begin()
            return self.out[:n]

        stream = torch.cuda.Stream()  # capture is not allowed on the default stream
        try:
            # Once eagerly first, so nothing compiles or allocates a workspace in capture.
            for layer in self.attn_layers:
                layer.split = skip
            forward()
            torch.cuda.synchronize()
            for layer in self.attn_layers:
                layer.split = split
            with torch.cuda.stream(stream):
                begin()
                pieces.hidden = forward()
                pieces.graphs[-1].capture_end()
        finally:
            for layer in self.attn_layers:
                layer.split = None
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.buckets[bucket] = pieces

    def replay(self, bucket: int, meta: AttentionMetadata) -> torch.Tensor:
        """Run the bucket's forward for this step's attention metadata; returns hidden
        states [bucket, hidden] (rows past the step's tokens are padding)."""
        pieces = self.buckets[bucket]
        query, out = self.query[:bucket], self.out[:bucket]
        for graph, layer in zip(pieces.graphs, pieces.layers):
            graph.replay()
            layer.attend(query, meta, out=out)
        pieces.graphs[-1].replay()
        return pieces.hidden
