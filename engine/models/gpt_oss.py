"""OpenAI's GPT-OSS (gpt-oss-20b, gpt-oss-120b): a Llama-shaped MoE. Its attention has
biases on q/k/v/o, a sink logit per head in every softmax's denominator, and alternating
sliding (128-token) and full layers; its experts are top-k routed (softmax over the
chosen logits) with biases on the router and on both projections, and a clamped SwiGLU.

The checkpoint stacks each layer's experts in one tensor per projection, in
transformers' layout: gate_up_proj [experts, hidden, 2 * inter] with gate and up
interleaved column by column, down_proj [experts, inter, hidden]. OpenAI's published
checkpoints store both as MXFP4 (`_blocks` and `_scales` tensors, `quant_method:
"mxfp4"`), which are dequantized here at load to the model's dtype."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from engine.models.experts import FusedMoE
from engine.models.llama import LlamaForCausalLM
from engine.models.parallel import TensorSlice, WeightSlice, check_shape
from engine.models.quantization import dequantize_mxfp4
from kernels.activation import ClampedSwiGLU

EXPERTS = re.compile(
    r"(layers\.\d+\.mlp)\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?"
)


class GptOssForCausalLM(LlamaForCausalLM):
    def make_mlp(self, config, layer: int) -> nn.Module:
        return FusedMoE(
            config.hidden_size,
            config.intermediate_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            True,  # softmax over the top-k logits: the top-k probabilities renormalized
            self.tp,
            bias=True,
            act=ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit),
        )

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        loaded: set[str] = set()
        packed: dict[str, WeightSlice] = {}  # an MXFP4 tensor's blocks or scales, until both

        def others() -> Iterator[tuple[str, WeightSlice]]:
            """Reads the stacked experts into FusedMoE; yields everything else."""
            for name, weight in weights:
                name = name.removeprefix("model.").replace(".mlp.router.", ".mlp.gate.")
                match = EXPERTS.fullmatch(name)
                if match is None:
                    yield name, weight
                    continue
                mlp, proj, kind = match[1], match[2], match[3] or ""
                moe = self.get_submodule(mlp)
                if kind in ("_blocks", "_scales"):
                    packed[name] = weight
                    blocks, scales = (packed.get(f"{mlp}.experts.{proj}{k}") for k in PAIR)
                    if blocks is None or scales is None:
                        continue
                    weight, kind = MxFp4(blocks, scales), ""
                load_experts(moe, proj + kind, weight, name)
                loaded.add(f"{mlp}.{OURS[proj + kind]}")

        rest = super().load_weights(others())  # runs others(), which fills `loaded`
        return rest | loaded


PAIR = ("_blocks", "_scales")
OURS = {
    "gate_up_proj": "w13",
    "gate_up_proj_bias": "b13",
    "down_proj": "w2",
    "down_proj_bias": "b2",
}


class MxFp4:
    """An MXFP4 tensor ([experts, rows, cols / 32] blocks of 16 bytes and their scales),
    read one expert at a time as the [rows, cols] matrix it encodes."""

    def __init__(self, blocks: WeightSlice, scales: WeightSlice) -> None:
        self.blocks, self.scales = blocks, scales
        experts, rows, groups, size = blocks.get_shape()
        check_shape(scales, [experts, rows, groups])
        self.shape = [experts, rows, groups * size * 2]

    def get_shape(self) -> list[int]:
        return self.shape

    def expert(self, e: int) -> torch.Tensor:
        return dequantize_mxfp4(self.blocks[e : e + 1][0], self.scales[e : e + 1][0])


def load_experts(moe: FusedMoE, tensor: str, weight: WeightSlice | MxFp4, name: str) -> None:
    """One stacked expert tensor into the FusedMoE's parameters, expert by expert (its
    load_shard takes this rank's share)."""
    num_experts, hidden, inter = moe.w2.shape[0], moe.w2.shape[1], moe.inter.size
    try:
        if tensor.endswith("_bias"):
            size = 2 * inter if tensor == "gate_up_proj_bias" else hidden
            check_shape(weight, [num_experts, size])
            for e in range(num_experts):
                row = weight[e : e + 1][0]
                if tensor == "down_proj_bias":
                    moe.load_shard("b2", TensorSlice(row), (e, None))
                else:  # gate and up interleaved
                    moe.load_shard("b13", TensorSlice(row[0::2]), (e, 0))
                    moe.load_shard("b13", TensorSlice(row[1::2]), (e, 1))
            return
        # As [out, in] per expert: MXFP4 holds that already, the plain tensor its transpose.
        rows, cols = (2 * inter, hidden) if tensor == "gate_up_proj" else (hidden, inter)
        packed = isinstance(weight, MxFp4)
        check_shape(weight, [num_experts, rows, cols] if packed else [num_experts, cols, rows])
        for e in range(num_experts):
            matrix = weight.expert(e) if packed else weight[e : e + 1][0].t()
            if tensor == "down_proj":
                moe.load_shard("w2", TensorSlice(matrix), (e, None))
            else:  # gate and up rows interleaved
                moe.load_shard("w13", TensorSlice(matrix[0::2]), (e, 0))
                moe.load_shard("w13", TensorSlice(matrix[1::2]), (e, 1))
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from err
