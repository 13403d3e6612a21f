"""The decode graph's copies as kernels (kernels/host_copy.py): only the named word
ranges come in, and on CUDA, inside a graph, each replay sees what the host wrote into
pinned memory since the last one, and the host reads what the graph wrote out."""

from __future__ import annotations

import pytest
import torch

from engine.staging import StagedFields
from kernels.host_copy import Segments, copy_segments, copy_to_host

CUDA = torch.cuda.is_available()


def host_words(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int64, pin_memory=CUDA)


def test_copy_segments_copies_the_ranges_only(device):
    src = host_words(1000)
    src.copy_(torch.arange(1000))
    dst = torch.full((1000,), -1, dtype=torch.int64, device=device)
    ranges = [(0, 3), (10, 300), (700, 1), (999, 1), (500, 0)]
    copy_segments(dst, src, Segments.of(ranges, device))
    want = torch.full((1000,), -1, dtype=torch.int64)
    for start, n in ranges:
        want[start : start + n] = torch.arange(start, start + n)
    assert torch.equal(dst.cpu(), want)


def test_copy_to_host(device):
    src = torch.arange(300, dtype=torch.int64, device=device) * 7
    dst = host_words(300)
    copy_to_host(dst, src)
    if CUDA:
        torch.cuda.synchronize()
    assert torch.equal(dst, src.cpu())


def test_word_ranges_cover_whole_words_of_each_prefix():
    fields = {"a": (5, torch.int32), "b": (3, torch.int64), "c": (9, torch.int32)}
    staged = StagedFields(fields, torch.device("cpu"))
    # Fields start 16-byte aligned: a at word 0 (20 bytes), b at word 4 (24), c at word 8.
    assert staged.word_ranges({"a": 3, "b": 3, "c": 0}) == [(0, 2), (4, 3), (8, 0)]
    with pytest.raises(AssertionError):
        staged.word_ranges({"b": 4})


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_graph_replays_see_the_hosts_new_words():
    device = torch.device("cuda")
    src, out_host = host_words(64), host_words(8)
    dst = torch.zeros(64, dtype=torch.int64, device=device)
    segments = Segments.of([(0, 8), (32, 16)], device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        copy_segments(dst, src, segments)
        copy_to_host(out_host, dst[:8] + dst[32:40])
    for step in range(1, 6):
        src.copy_(torch.arange(64) * step)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(dst[:8].cpu(), torch.arange(8) * step)
        assert torch.equal(dst[32:48].cpu(), torch.arange(32, 48) * step)
        assert torch.equal(out_host, (torch.arange(8) + torch.arange(32, 40)) * step)
