"""How many kernels a decode layer launches on CUDA, counted on CPU: every torch op that
would launch one (views and allocations do not), with each op a model chooses per device
(`*_for`: one Triton kernel on CUDA) counted once. A copy, cat or cast that creeps back
into the decode path shows up here as a larger count."""

from __future__ import annotations

import collections

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

import engine.models.layers as layers
import engine.models.llama as llama
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.layers import AttentionMetadata, AttentionOps, PagedAttention
from engine.models.rope import RotaryEmbedding
from kernels.activation import act_and_mul_ref
from kernels.attention_ref import paged_attention_decode_ref, paged_prefill_attention_ref
from kernels.kv_store import kv_store_ref
from kernels.norms import add_norm_ref
from kernels.rotary import rotary_ref

NO_LAUNCH = {"view", "_unsafe_view", "slice", "split", "split_with_sizes", "chunk", "t"}
NO_LAUNCH |= {"transpose", "expand", "as_strided", "alias", "detach", "unsqueeze", "select"}
NO_LAUNCH |= {"empty", "empty_like", "empty_strided"}


class LaunchCounter(TorchDispatchMode):
    """Counts launching ops while `on`; inside a counted fused op, nothing more."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.on = False
        self.inside_fused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        storage = out.untyped_storage().data_ptr() if name == "reshape" else None
        if storage is not None and storage != args[0].untyped_storage().data_ptr():
            name = "reshape (a copy)"
        if self.on and not self.inside_fused and name not in NO_LAUNCH | {"reshape"}:
            self.counts[name] += 1
        return out

    def fused(self, name: str, fn):
        def launch(*args, **kwargs):
            if self.on and not self.inside_fused:
                self.counts[name] += 1
            self.inside_fused += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside_fused -= 1

        return launch


SMALL = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
)
MODELS = {
    "llama": lambda: llama.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)),
    "qwen2": lambda: llama.LlamaForCausalLM(transformers.Qwen2Config(**SMALL)),
    "qwen3": lambda: llama.LlamaForCausalLM(transformers.Qwen3Config(**SMALL)),
    "gemma3": lambda: Gemma3ForCausalLM(
        transformers.Gemma3TextConfig(
            **SMALL, sliding_window=8, layer_types=["sliding_attention", "full_attention"]
        )
    ),
}
# add_norm x2 (Gemma 3: x4, a norm before and after each sublayer), the qkv, o, gate_up
# and down GEMMs, decode attention (rotary with the q/k norms, and the K/V store,
# included), act_and_mul.
EXPECTED = {
    "llama": 8,
    "qwen2": 8,
    "qwen3": 8,
    "gemma3": 10,
}


@pytest.mark.parametrize("kind", list(MODELS))
def test_decode_layer_launches(kind, monkeypatch):
    counter = LaunchCounter()
    monkeypatch.setattr(layers, "add_norm_for", lambda d: counter.fused("add_norm", add_norm_ref))
    monkeypatch.setattr(layers, "rotary_for", lambda d: counter.fused("rotary", rotary_ref))
    monkeypatch.setattr(
        llama, "act_and_mul_for", lambda d: counter.fused("act_and_mul", act_and_mul_ref)
    )
    ops = AttentionOps(
        counter.fused("kv_store", kv_store_ref),
        counter.fused("decode_attention", paged_attention_decode_ref),
        counter.fused("prefill_attention", paged_prefill_attention_ref),
    )
    model = MODELS[kind]().to(torch.bfloat16).eval()
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.build_cache(torch.device("cpu"))
        if isinstance(module, PagedAttention):
            shape = (4, 16, module.num_kv_heads, module.head_dim)
            module.k_cache = torch.zeros(shape, dtype=torch.bfloat16)
            module.v_cache = torch.zeros(shape, dtype=torch.bfloat16)
            module.ops = ops
    meta = AttentionMetadata(  # two sequences of 6 and 5 tokens, decoding one each
        slot_mapping=torch.tensor([5, 20]),
        block_table=torch.tensor([[0], [1]], dtype=torch.int32),
        seq_lens=torch.tensor([6, 5], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        max_query_len=1,
        is_decode=True,
    )
    layer = model.layers[1]
    layer.register_forward_pre_hook(lambda *_: setattr(counter, "on", True))
    layer.register_forward_hook(lambda *_: setattr(counter, "on", False))
    with torch.inference_mode(), counter:
        model(torch.tensor([1, 2]), torch.tensor([5, 4]), meta)
    assert sum(counter.counts.values()) == EXPECTED[kind], dict(counter.counts)
    assert counter.counts["decode_attention"] == 1 and counter.counts["act_and_mul"] == 1
    assert counter.counts["rotary"] == 0 and counter.counts["kv_store"] == 0
