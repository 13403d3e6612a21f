"""Images on CUDA at fp32 (the vision tower on the GPU, eager prefill steps with image
rows, Gemma 3's horizons in the Triton prefill kernel, decode graphs after them):
LLaVA's, Mistral 3's and Gemma 3's greedy output equals
transformers' on CPU, whole and in chunks that split an image, beside text-only
requests in the same batch."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from tests.engine.test_images import image_inputs, reference, run, vlm, vlm_of  # noqa: F401
from tests.gpu.on_cuda import GPU

pytestmark = GPU


@pytest.mark.parametrize("budget", [2048, 8])
def test_images_on_cuda_match_transformers(vlm, budget):  # noqa: F811 (the fixture)
    kind, path, ids, model = vlm
    first, _ = image_inputs(kind, 1)
    second, _ = image_inputs(kind, 2)
    config = EngineConfig(
        model=str(path), device="cuda", dtype="float32", max_num_batched_tokens=budget
    )
    engine = Engine(config)
    got = run(engine, {"a": (ids, first), "b": (ids, second), "text": (ids, None)})
    assert got["a"] == reference(model, ids, first)
    assert got["b"] == reference(model, ids, second)
    assert engine.runner.steps_by_path["eager"] > 0 and engine.runner.graphs.decode


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("family", ["gemma3", "qwen3_vl"])
def test_images_over_two_gpus_match_transformers(vlm_of, family):  # noqa: F811 (the fixture)
    """NCCL: rank 0 encodes and broadcasts the step's image rows, features, horizons
    (Gemma 3's image tokens see their whole image; chunks never split one), 3-D
    positions and deepstack features (Qwen3-VL)."""
    kind, path, ids, model = vlm_of(family)
    images, _ = image_inputs(kind, 1)
    config = EngineConfig(
        model=str(path), device="cuda", dtype="float32", tensor_parallel_size=2,
        max_num_batched_tokens=8,
    )  # fmt: skip
    engine = Engine(config)
    try:
        got = run(engine, {"a": (ids, images), "text": (ids, None)})
    finally:
        engine.shutdown()
    assert got["a"] == reference(model, ids, images)
