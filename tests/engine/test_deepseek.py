"""DeepSeek's pieces the tiny checkpoints leave out: V2's group-limited routing against
transformers' router, and the head layout MLA's rotation reads."""

from __future__ import annotations

import torch

from engine.models.deepseek import limited_topk, mla_dim_order


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


def test_the_rotary_pairs_sit_at_the_start_of_each_half():
    # 4 nope dims, 4 rotary ones (dims 4-7), head 8: the kernels pair j with j + 4.
    assert mla_dim_order(4, 4, interleaved=False) == [4, 5, 0, 1, 6, 7, 2, 3]
    assert mla_dim_order(4, 4, interleaved=True) == [4, 6, 0, 1, 5, 7, 2, 3]
