"""DeepSeek's pieces the tiny checkpoints leave out: V2's group-limited routing against
transformers' router, the rotary layout MLA's rotation reads, and the latent cache's size."""

from __future__ import annotations

import numpy as np
import torch

from engine import LLM, SamplingParams
from engine.models.deepseek import MlaAttention, rope_pair_order
from kernels.moe_routing import limited_topk
from tests.reference import PROMPTS


def test_group_limited_routing_is_transformers():
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = DeepseekV2Config(
        hidden_size=32,
        n_routed_experts=16,
        num_experts_per_tok=3,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
    )
    router = DeepseekV2TopkRouter(config)
    torch.manual_seed(0)
    router.weight.data.normal_(0.0, 0.1)  # scores close enough that groups' best and sum differ
    x = torch.randn(64, 32)
    _, want_weights, want_ids = router(x)
    logits = x @ router.weight.t()
    weights, ids = limited_topk(logits, 3, 4, 2, 1.5)
    # The experts and their weights, whatever order topk leaves them in.
    got = sorted(zip(ids.flatten().tolist(), weights.flatten().tolist()))
    want = sorted(zip(want_ids.flatten().tolist(), want_weights.flatten().tolist()))
    assert [i for i, _ in got] == [i for i, _ in want]
    torch.testing.assert_close(
        torch.tensor([w for _, w in got]), torch.tensor([w for _, w in want])
    )
    # Only the two best groups' experts (by their best expert) are ever picked.
    groups = ids // 4
    best = logits.softmax(-1).view(64, 4, 4).amax(-1).topk(2, dim=-1).indices
    assert all(set(g.tolist()) <= set(b.tolist()) for g, b in zip(groups, best))


def test_interleaved_rotary_pairs_become_halves():
    # Pairs (0, 1), (2, 3), ... of an interleaving checkpoint: the kernels pair j, j + 4.
    assert rope_pair_order(8, interleaved=True) == [0, 2, 4, 6, 1, 3, 5, 7]
    assert rope_pair_order(8, interleaved=False) == list(range(8))


def test_the_cache_holds_one_latent_row_a_token(tiny_family_dir):
    llm = LLM(tiny_family_dir("deepseek_v2"), device="cpu", block_size=4)
    runner, config = llm.engine.runner, llm.engine.model.config
    row = (config.kv_lora_rank + config.qk_rope_head_dim) * 4  # fp32
    assert runner.bytes_per_block() == row * 4 * config.num_hidden_layers
    layer = runner.attn_layers[0]
    assert layer.v_cache is layer.k_cache and layer.k_cache.shape[2:] == (1, row // 4)


def test_speculative_verify_rows_equal_plain_decoding(tiny_family_dir):
    # Verify steps attend one row a token over per-token block tables. Drafts: the plain
    # run's next two tokens, then a wrong one, so each step accepts some and rejects one.
    model_dir = tiny_family_dir("deepseek_v3")
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [PROMPTS[3], PROMPTS[6]]
    plain = LLM(model_dir, device="cpu").generate(prompts, params, use_tqdm=False)
    full = [o.prompt_token_ids + o.outputs[0].token_ids for o in plain]
    spec = LLM(model_dir, device="cpu", num_speculative_tokens=3)

    def oracle(slot: int, tokens: np.ndarray, k: int) -> np.ndarray:
        ids = next(f for f in full if f[: len(tokens)] == tokens.tolist())
        right = ids[len(tokens) : len(tokens) + 2]
        return np.array(right + [(right[-1] + 1) % 64] if right else [], dtype=np.int64)

    spec.engine.speculator.draft = oracle
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert spec.engine.speculator.num_accepted_tokens > 20


def test_whole_prompts_expand_and_the_rest_attend_to_latents(tiny_family_dir, monkeypatch):
    calls: list[int] = []
    expand = MlaAttention.attend_prompts

    def counted(self, q_nope, *args):
        calls.append(len(q_nope))
        return expand(self, q_nope, *args)

    monkeypatch.setattr(MlaAttention, "attend_prompts", counted)
    llm = LLM(tiny_family_dir("deepseek_v3"), device="cpu", block_size=4)
    layers = llm.engine.model.config.num_hidden_layers
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompt = PROMPTS[3] + " " + PROMPTS[6]
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    assert calls == [len(first.prompt_token_ids)] * layers  # its prompt step only
    again = llm.generate([prompt + " more"], params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and len(calls) == layers  # after a cached prefix: not
