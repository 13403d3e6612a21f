"""DeepSeek-V2, V2-Lite, V3 and R1 (`deepseek_v2`, `deepseek_v3`): multi-head latent
attention (MLA), and shared-expert MoE layers after the first `first_k_dense_replace`
dense ones.

MLA projects each token to a latent c (kv_lora_rank wide, RMS-normed) and one rotary key
k_pe shared by the heads; kv_b_proj would expand c into each head's k_nope and v. The
paged cache holds only c and k_pe, one row a token (kv_lora_rank + qk_rope_head_dim
values, against num_heads * (qk_nope + qk_rope + v) expanded), and kv_b_proj's halves are
absorbed instead: q_nope @ W_UK puts each head's query in the latent's space, and the
attention's output, a mix of latents, goes through W_UV (kernels/mla.py). q's rows are
laid out at load as every head's nope part, then every head's rotary part, its pairs
de-interleaved where the checkpoint interleaves them.

Routing: V3's as GLM-4.5's (sigmoid, a learned correction, groups; glm4_moe.py); V2's a
softmax over the experts, top-k over all of them (`greedy`) or within the best
`topk_group` of `n_group` groups by their best expert (`group_limited_greedy`), times
`routed_scaling_factor`. The multi-token-prediction layers past num_hidden_layers are
not run."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from engine.distributed import TensorParallel
from engine.models.experts import FusedMoE
from engine.models.glm4_moe import Glm4MoE, Mistral4MoE
from engine.models.layers import AttentionMetadata, PagedAttention, RMSNorm
from engine.models.llama import LlamaDecoderLayer, LlamaMLP
from engine.models.moe import MoeForCausalLM
from engine.models.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    WeightSlice,
    permute_rows_,
    split,
)
from engine.models.rope import RotaryEmbedding, rope_settings, rope_type
from kernels.fp8 import Fp8Rows
from kernels.mla import mla_attention_for
from kernels.mla_store import LatentRows, mla_store_for
from kernels.moe_routing import limited_topk_for
from kernels.prefill_attention import paged_prefill_attention_for
from kernels.rotary import Rope, rotary_for


def rope_pair_order(rope: int, interleaved: bool) -> list[int]:
    """The rotary dims in the kernels' rotate-half order (pairs at j and j + rope / 2):
    entry j is the checkpoint's dim now at j."""
    return [*range(0, rope, 2), *range(1, rope, 2)] if interleaved else list(range(rope))


def yarn_mscale(scaling: dict | None) -> float:
    """YaRN's factor on DeepSeek's softmax scale (mscale_all_dim, squared), as transformers'."""
    if rope_type(scaling) == "default" or not (scaling or {}).get("mscale_all_dim"):
        return 1.0
    factor = scaling["factor"]
    m = 0.1 * scaling["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
    return m * m


class LatentUpProjection(ColumnParallelLinear):
    """kv_b_proj: never run as a linear, its weight read per head as W_UK and W_UV. A
    type of its own, so that `--quantization fp8` leaves it in the model dtype."""


class LatentCache(PagedAttention):
    """The layer's latent cache and its attention: one row a token, [c | k_pe], read as
    every head's K and, its first `latent` values, V (kernels/mla.py)."""

    KV_TENSORS = 1  # no V cache of its own
    PROMPTS_APART = True  # MlaAttention expands whole prompts' K and V instead

    def __init__(self, num_heads: int, latent: int, rope: int, scale: float) -> None:
        super().__init__(num_heads, 1, latent + rope, scale)
        self.latent = latent

    def store(self, c: torch.Tensor, k_pe: torch.Tensor, meta: AttentionMetadata) -> None:
        # An FP8 cache holds the rows / k_scale (the checkpoint's, else 1.0), as vLLM's.
        mla_store_for(c.device)(c, k_pe, self.k_cache, meta.slot_mapping, self.k_scale)

    def forward(
        self,
        q_lat: torch.Tensor,  # [n, heads, latent]
        q_pe: torch.Tensor,  # [n, heads, rope], rotated unless `new`
        meta: AttentionMetadata,
        new: LatentRows | None = None,  # a decode step's: the kernel finishes and stores them
    ) -> torch.Tensor:  # [n, heads, latent]
        device = q_lat.device
        one_per_seq = meta.is_decode or meta.per_token
        return mla_attention_for(device)(
            q_lat,
            q_pe,
            self.k_cache,
            meta.block_table,
            None if one_per_seq else meta.query_start_loc,
            meta.seq_lens,
            self.scale,
            meta.max_query_len,
            self.k_scale,
            new,
        )


class MlaAttention(nn.Module):
    """q (q_proj, or V3's q_a_proj -> norm -> q_b_proj) and kv_b_proj column-parallel by
    head, kv_a_proj_with_mqa replicated (so is the latent cache), o_proj row-parallel."""

    def __init__(self, config, rotary: RotaryEmbedding, tp: TensorParallel) -> None:
        super().__init__()
        heads = split(config.num_attention_heads, tp, "num_attention_heads")
        self.num_heads = heads.local_size
        self.nope, self.rope, self.v_dim = (
            config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        )  # fmt: skip
        if self.rope % 2 or self.v_dim > self.nope + self.rope:  # V padded to K's width
            raise ValueError(
                f"unsupported MLA head dims: qk {self.nope}+{self.rope}, v {self.v_dim}"
            )
        self.kv_rank = config.kv_lora_rank
        hidden, bias = config.hidden_size, getattr(config, "attention_bias", False)
        total = config.num_attention_heads
        self.q_lora = getattr(config, "q_lora_rank", None)
        if self.q_lora:
            self.q_a_proj = nn.Linear(hidden, self.q_lora, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora, config.rms_norm_eps)
            q_in = self.q_lora
        else:
            q_in = hidden
        # q_proj (V2-Lite) or q_b_proj: each head's q, by a name LlamaForCausalLM's loading
        # leaves alone (its q_proj is a section of qkv_proj).
        dim = self.nope + self.rope
        self.q_heads = ColumnParallelLinear(q_in, [split(total * dim, tp, "q rows")], bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, config.rms_norm_eps)
        kv_rows = split(total * (self.nope + self.v_dim), tp, "kv_b_proj rows")
        self.kv_b_proj = LatentUpProjection(self.kv_rank, [kv_rows], bias=False)
        self.o_proj = RowParallelLinear(total * self.v_dim, hidden, bias, tp)
        self.rotary = rotary
        # V3's q norm feeds q_b_proj alone (quantize_model: see fp8_out).
        self.FP8_FEEDS = {"q_a_layernorm": "q_heads"} if self.q_lora else {}
        scale = dim**-0.5 * yarn_mscale(rope_settings(config)[1])
        self.attn = LatentCache(self.num_heads, self.kv_rank, self.rope, scale)
        self.interleaved = config.model_type == "deepseek_v2" or getattr(
            config, "rope_interleave", False
        )
        # Mistral 4's query scale by position [n, 1], the same in every layer: set once a
        # step from DeepseekForCausalLM.query_scale (None: no scale).
        self.q_scale: torch.Tensor | None = None

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor | Fp8Rows, meta: AttentionMetadata
    ) -> torch.Tensor:
        n, num = len(positions), self.num_heads
        q_in = self.q_a_layernorm(self.q_a_proj(x))[0] if self.q_lora else x
        q = self.q_heads(q_in)  # [n, heads * nope | heads * rope]
        if self.q_scale is not None:
            q = q * self.q_scale.to(q.dtype)
        q_nope = q[:, : num * self.nope].view(n, num, self.nope)
        latent = self.kv_a_proj_with_mqa(x)  # [n, kv_rank + rope]
        w = self.kv_b_proj.weight.view(num, self.nope + self.v_dim, self.kv_rank)
        if meta.is_decode:  # the attention kernel norms, rotates and stores: 3 launches fewer
            q_pe = q[:, num * self.nope :].view(n, num, self.rope)
            rope = Rope(positions, self.rotary.cos_sin)
            norm = self.kv_a_layernorm
            new = LatentRows(latent, norm.weight, norm.eps, rope, meta.slot_mapping)
            return self.absorbed(q_nope, q_pe, w, meta, new)
        c = self.kv_a_layernorm(latent[:, : self.kv_rank])[0]
        # In place on CUDA (the reference returns new tensors).
        q_pe, k_pe = rotary_for(q.device)(
            positions, q[:, num * self.nope :], latent[:, self.kv_rank :], self.rotary.cos_sin
        )
        self.attn.store(c, k_pe, meta)
        q_pe = q_pe.view(n, num, self.rope)
        if meta.prompts_only:
            return self.o_proj(self.attend_prompts(q_nope, q_pe, c, k_pe, meta))
        return self.absorbed(q_nope, q_pe, w, meta)

    def absorbed(
        self,
        q_nope: torch.Tensor,  # [n, heads, nope]
        q_pe: torch.Tensor,  # [n, heads, rope]
        w: torch.Tensor,  # kv_b_proj's weight [heads, nope + v_dim, kv_rank]
        meta: AttentionMetadata,
        new: LatentRows | None = None,
    ) -> torch.Tensor:  # [n, hidden]
        """Attention over the latent cache, W_UK folded into q and W_UV into the output."""
        n, num = q_nope.shape[:2]
        q_lat = torch.bmm(q_nope.transpose(0, 1), w[:, : self.nope])  # [heads, n, kv_rank]
        out = self.attn(q_lat.transpose(0, 1), q_pe, meta, new)
        o = torch.bmm(out.transpose(0, 1), w[:, self.nope :].transpose(1, 2))  # [heads, n, v]
        return self.o_proj(o.transpose(0, 1).reshape(n, num * self.v_dim))

    def attend_prompts(
        self,
        q_nope: torch.Tensor,  # [n, heads, nope]
        q_pe: torch.Tensor,  # [n, heads, rope]
        c: torch.Tensor,  # [n, kv_rank]
        k_pe: torch.Tensor,  # [n, rope]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [n, heads * v_dim]
        """A step of whole prompts, whose keys are all its own tokens: each head's K and V
        expanded from them (kv_b_proj) for the prefill kernel, where the absorbed form
        would cost (kv_rank + rope + kv_rank) / (nope + rope + v_dim) times the FLOPs
        (3.4x at DeepSeek's dims). Token i is one-token block i of a cache of the step's
        own K and V, which the prefill kernel reads as it reads the paged one."""
        n, num = q_nope.shape[:2]
        nope, rope, dim = self.nope, self.rope, self.nope + self.rope
        kv = self.kv_b_proj(c).view(n, num, nope + self.v_dim)
        k = torch.cat([kv[..., :nope], k_pe[:, None, :].expand(n, num, rope)], dim=-1)
        v = nn.functional.pad(kv[..., nope:], (0, dim - self.v_dim))  # as wide as K
        q = torch.cat([q_nope, q_pe], dim=-1)
        qsl = meta.query_start_loc
        width = torch.arange(max(meta.max_query_len, 1), dtype=qsl.dtype, device=qsl.device)
        table = qsl[:-1, None] + width[None, :]  # sequence s's tokens: its blocks
        out = paged_prefill_attention_for(q.device)(
            q,
            k.view(n, 1, num, dim),
            v.view(n, 1, num, dim),
            table,
            qsl,
            meta.seq_lens,
            self.attn.scale,
            meta.max_query_len,
        )
        return out[..., : self.v_dim].reshape(n, num * self.v_dim)

    @torch.no_grad()
    def reorder_rotary_dims(self) -> None:
        """q's rows as forward reads them (every head's nope rows, then every head's
        rotary rows) and kv_a_proj_with_mqa's rotary rows, pairs de-interleaved where the
        checkpoint interleaves them."""
        num, nope, rope = self.num_heads, self.nope, self.rope
        device = self.q_heads.weight.device
        order = torch.tensor(rope_pair_order(rope, self.interleaved), device=device)
        heads = torch.arange(num, device=device)[:, None] * (nope + rope)
        nope_rows = heads + torch.arange(nope, device=device)
        rope_rows = heads + nope + order
        q_rows = torch.cat([nope_rows.flatten(), rope_rows.flatten()])
        permute_rows_(self.q_heads, slice(None), q_rows)
        permute_rows_(self.kv_a_proj_with_mqa, slice(self.kv_rank, None), order)


class DeepseekV2MoE(FusedMoE):
    def __init__(self, config, tp: TensorParallel) -> None:
        inter = config.moe_intermediate_size
        experts, top_k = config.n_routed_experts, config.num_experts_per_tok
        super().__init__(config.hidden_size, inter, experts, top_k, False, tp)
        grouped = getattr(config, "topk_method", "greedy") == "group_limited_greedy"
        self.num_groups = config.n_group if grouped else 1
        self.topk_groups = config.topk_group if grouped else 1
        self.scale = float(config.routed_scaling_factor)
        shared = inter * config.n_shared_experts
        self.shared_experts = LlamaMLP(config, tp, intermediate_size=shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        route = limited_topk_for(x.device)
        weights, ids = route(logits, self.top_k, self.num_groups, self.topk_groups, self.scale)
        return self.routed(x, weights, ids) + self.shared_experts(x)


class DeepseekForCausalLM(MoeForCausalLM):
    LORA_FUSED = None  # MLA's projections are not the Llama ones adapters name

    @staticmethod
    def check_config(config) -> None:
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (only silu)")
        method = getattr(config, "topk_method", None)
        if config.model_type == "deepseek_v2" and method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"unsupported topk_method {method!r}")

    def make_layers(self, config) -> list[nn.Module]:
        theta, scaling = rope_settings(config)
        rope = config.qk_rope_head_dim
        if scaling is not None:  # Mistral 4's says what share of a head qk_rope_head_dim is
            scaling = {k: v for k, v in scaling.items() if k != "partial_rotary_factor"}
        # Mistral 4's long-context query scale: 1 + beta * log(1 + floor(pos / original)).
        self.q_scaling = (scaling or {}).get("llama_4_scaling_beta")
        self.rotary = RotaryEmbedding(rope, config.max_position_embeddings, theta, scaling)
        layers = [
            LlamaDecoderLayer(
                config,
                self.rotary,
                0,
                self.make_mlp(config, i),
                self.tp,
                self_attn=MlaAttention(config, self.rotary, self.tp),
            )
            for i in range(config.num_hidden_layers)
        ]
        # The attention's norm feeds two projections: q's first and kv_a_proj_with_mqa.
        q_in = "self_attn.q_a_proj" if getattr(config, "q_lora_rank", None) else "self_attn.q_heads"
        feeds = {"input_layernorm": (q_in, "self_attn.kv_a_proj_with_mqa")}
        for layer in layers:
            layer.FP8_FEEDS = feeds | {"post_attention_layernorm": "mlp.gate_up_proj"}
        return layers

    def make_mlp(self, config, layer: int) -> nn.Module:
        kinds = getattr(config, "mlp_layer_types", None)  # GLM-4.7-Flash's, else by count
        dense = kinds[layer] == "dense" if kinds else layer < config.first_k_dense_replace
        if dense or not config.n_routed_experts:
            return LlamaMLP(config, self.tp)
        if config.model_type == "deepseek_v2":
            return DeepseekV2MoE(config, self.tp)
        if config.model_type == "mistral4":
            return Mistral4MoE(config, self.tp)
        return Glm4MoE(config, self.tp)

    def query_scale(self, positions: torch.Tensor) -> torch.Tensor | None:
        if not (beta := self.q_scaling):
            return None
        original = self.rotary.scaling["original_max_position_embeddings"]
        return (1.0 + beta * torch.log1p(torch.floor(positions.float() / original)))[:, None]

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> set[str]:
        def kept() -> Iterator[tuple[str, WeightSlice]]:
            for name, weight in weights:
                for theirs in (".self_attn.q_proj.", ".self_attn.q_b_proj."):
                    name = name.replace(theirs, ".self_attn.q_heads.")
                yield name, weight

        return super().load_weights(kept())  # which reorders q's and k_pe's rotary dims
