"""LoRA adapters: the base model and every adapter in one batch give transformers +
peft's greedy tokens, through chunked prefill and the prefix cache, on one rank and
two (gloo); adapters the code would serve wrong are refused by name."""

from __future__ import annotations

import json
import shutil

import pytest

from engine import LLM, SamplingParams
from engine.models.loader import ModelLoadError, load_tokenizer
from tests.reference import PROMPTS, peft_greedy
from tests.tiny_checkpoints import build_lora

MAX_NEW = 10
# Prompts chunk (a 16-token budget) and fill 4-token blocks the prefix cache can share.
CONFIG = dict(
    device="cpu",
    block_size=4,
    num_kv_blocks=128,
    max_model_len=64,
    max_num_seqs=4,
    max_num_batched_tokens=16,
)


def greedy(lora_name: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, lora_name=lora_name)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, tiny_lora_adapters) -> LLM:
    return LLM(tiny_llama_dir, lora_modules=tiny_lora_adapters, **CONFIG)


def expected(base: str, adapters: dict[str, str], prompts: list[str], names: list) -> list:
    tokenizer = load_tokenizer(base)
    return [
        peft_greedy(base, adapters.get(name), tokenizer.encode(p), MAX_NEW)
        for p, name in zip(prompts, names)
    ]


def generate(llm: LLM, prompts: list[str], names: list) -> list:
    return llm.generate(prompts, [greedy(n) for n in names], use_tqdm=False)


def test_the_base_and_every_adapter_match_peft_in_one_batch(
    llm, tiny_llama_dir, tiny_lora_adapters
):
    prompts = PROMPTS[1:5] + PROMPTS[1:3]
    names = [None, "all", "qv", "all", "qv", None]
    got = [o.outputs[0].token_ids for o in generate(llm, prompts, names)]
    want = expected(tiny_llama_dir, tiny_lora_adapters, prompts, names)
    assert got == want
    # The adapters change the tokens: the comparison has something to tell apart.
    assert got[0] != got[4] and got[1] != got[5]


def test_the_prefix_cache_keeps_each_adapters_blocks_apart(llm, tiny_llama_dir, tiny_lora_adapters):
    prompt = PROMPTS[5]  # ~20 tokens: several full blocks
    base = generate(llm, [prompt], [None])[0]
    first = generate(llm, [prompt], ["all"])[0]
    again = generate(llm, [prompt], ["all"])[0]
    want = expected(tiny_llama_dir, tiny_lora_adapters, [prompt], ["all"])[0]
    assert first.num_cached_tokens == 0  # the base model's blocks are not the adapter's
    assert first.outputs[0].token_ids == want
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == want
    assert generate(llm, [prompt], [None])[0].num_cached_tokens > 0
    assert base.outputs[0].token_ids != want
    # Nor are another adapter's (adapters 0 and 1 once shared a root: hash(-1) == hash(-2)).
    other = generate(llm, [prompt], ["qv"])[0]
    assert other.num_cached_tokens == 0
    assert (
        other.outputs[0].token_ids
        == expected(tiny_llama_dir, tiny_lora_adapters, [prompt], ["qv"])[0]
    )


def test_a_larger_max_lora_rank_pads_without_changing_tokens(
    llm, tiny_llama_dir, tiny_lora_adapters
):
    padded = LLM(tiny_llama_dir, lora_modules=tiny_lora_adapters, max_lora_rank=16, **CONFIG)
    prompts, names = PROMPTS[2:4], ["all", "qv"]
    assert padded.engine.model.lora_slots.state.rank == 16
    got = [o.outputs[0].token_ids for o in generate(padded, prompts, names)]
    assert got == [o.outputs[0].token_ids for o in generate(llm, prompts, names)]


def test_an_unknown_adapter_is_refused_before_any_work(llm):
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
        generate(llm, PROMPTS[1:3], [None, "nope"])
    assert not llm.engine.has_unfinished_requests()


def test_adapters_that_cannot_be_served_are_refused_by_name(
    tmp_path, tiny_llama_dir, tiny_gpt2_dir, tiny_lora_adapters
):
    def refused(base: str, adapter: str, match: str, **config) -> None:
        with pytest.raises(ModelLoadError, match=match):
            LLM(base, lora_modules={"x": adapter}, **(CONFIG | config))

    refused(
        tiny_llama_dir,
        tiny_lora_adapters["all"],
        "rank 8, above --max-lora-rank 4",
        max_lora_rank=4,
    )
    refused(tiny_gpt2_dir, tiny_lora_adapters["all"], "not supported for gpt2 models")
    head = build_lora(tiny_llama_dir, tmp_path / "head", 3, r=4, target_modules=["lm_head"])
    refused(tiny_llama_dir, head, "lm_head")
    for key, value, match in (
        ("use_dora", True, "DoRA is not supported"),
        ("bias", "all", "bias='all' is not supported"),
        ("modules_to_save", ["lm_head"], "modules_to_save"),
    ):
        changed = tmp_path / key
        shutil.copytree(tiny_lora_adapters["qv"], changed)
        config = json.loads((changed / "adapter_config.json").read_text())
        (changed / "adapter_config.json").write_text(json.dumps(config | {key: value}))
        refused(tiny_llama_dir, str(changed), match)


def test_two_ranks_match_peft(tiny_llama_dir, tiny_lora_adapters):
    """Column-parallel stacks hold their rows of B, row-parallel ones their columns of A
    (the deltas summed by the projections' all_reduce). An adapter loaded while serving
    reaches the other rank's slot too."""
    tp2 = LLM(
        tiny_llama_dir,
        lora_modules={"qv": tiny_lora_adapters["qv"]},
        enable_lora=True,
        max_loras=2,
        tensor_parallel_size=2,
        **CONFIG,
    )
    try:
        tp2.load_lora("all", tiny_lora_adapters["all"])
        prompts, names = PROMPTS[1:4], ["qv", None, "all"]
        got = [o.outputs[0].token_ids for o in generate(tp2, prompts, names)]
        assert got == expected(tiny_llama_dir, tiny_lora_adapters, prompts, names)
    finally:
        tp2.shutdown()


def test_each_projection_stacks_its_sections(llm):
    """q, k, v and gate, up are adapted each on their own columns of the fused stack."""
    stacks = {n: m for n, m in llm.engine.model.named_modules() if n.endswith(".lora")}
    sections = {n.split(".")[-2]: m.k for n, m in stacks.items()}
    assert len(stacks) == 2 * 4
    assert sections == {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}


@pytest.mark.parametrize(
    "kind, targets",
    [
        ("qwen3", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
        # Phi-3's checkpoint fuses gate_up_proj: adapted whole, one section.
        ("phi3", ["o_proj", "gate_up_proj", "down_proj"]),
    ],
)
def test_other_families_match_peft(tmp_path, tiny_family_dir, kind, targets):
    base = tiny_family_dir(kind)
    adapter = build_lora(base, tmp_path / kind, 4, r=8, lora_alpha=16, target_modules=targets)
    llm = LLM(base, lora_modules={"a": adapter}, **CONFIG)
    prompts, names = PROMPTS[1:4], ["a", None, "a"]
    got = [o.outputs[0].token_ids for o in generate(llm, prompts, names)]
    assert got == expected(base, {"a": adapter}, prompts, names)


def test_q_and_k_under_partial_rotary_are_refused(tmp_path, tiny_family_dir):
    """Phi-3's partial rotary reorders q/k rows at load; its fused qkv_proj holds them."""
    base = tiny_family_dir("phi3")
    adapter = build_lora(base, tmp_path / "qkv", 5, r=4, target_modules=["qkv_proj"])
    with pytest.raises(ModelLoadError, match="reordered for partial rotary"):
        LLM(base, lora_modules={"a": adapter}, **CONFIG)
