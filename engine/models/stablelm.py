"""Stability AI's StableLM 2 (`stablelm`): Llama's layers with LayerNorms (biased), a
quarter of each head rotated (`partial_rotary_factor`), q/k/v biases where
`use_qkv_bias` (none on o_proj); the per-head q/k LayerNorms (`qk_layernorm`) and the
parallel residual (`use_parallel_residual`) of stablelm-2-12b are refused."""

from __future__ import annotations

from torch import nn

from engine.distributed import SINGLE, TensorParallel
from engine.models.layers import LayerNorm
from engine.models.llama import AttentionOptions, LlamaForCausalLM, check_config


def check_stablelm_config(config) -> None:
    check_config(config)
    for field in ("qk_layernorm", "use_parallel_residual"):
        if getattr(config, field, False):
            raise ValueError(f"unsupported {field}=True (stablelm-2-12b's)")


class StableLmForCausalLM(LlamaForCausalLM):
    check_config = staticmethod(check_stablelm_config)

    def __init__(self, config, tp: TensorParallel = SINGLE) -> None:
        self.ATTENTION = AttentionOptions(qkv_bias=config.use_qkv_bias, o_bias=False)
        super().__init__(config, tp)

    def make_norm(self, config) -> nn.Module:
        return LayerNorm(config.hidden_size, config.layer_norm_eps)
