"""LoRA adapters loaded and unloaded while serving (--enable-lora): a slot's new adapter
gives peft's tokens beside the others, never the last occupant's cached prefixes; a
slot frees only once its requests are done; what cannot load is refused by name."""

from __future__ import annotations

import pytest

from engine import LLM, LoRARequest, SamplingParams
from engine.models.lora import LoRAError
from tests.engine.test_lora import CONFIG, MAX_NEW, expected, generate, greedy
from tests.reference import PROMPTS
from tests.tiny_checkpoints import build_lora


@pytest.fixture(scope="module")
def third(tmp_path_factory, tiny_llama_dir) -> str:
    """A third adapter, on the MLP only: what a reused slot must hold instead of 'all'."""
    path = tmp_path_factory.mktemp("lora-mlp") / "mlp"
    return build_lora(tiny_llama_dir, path, 3, r=4, target_modules=["gate_proj", "down_proj"])


def test_adapters_loaded_while_serving_match_peft_and_reuse_slots(
    tiny_llama_dir, tiny_lora_adapters, third
):
    llm = LLM(tiny_llama_dir, enable_lora=True, max_loras=2, **CONFIG)
    adapters = tiny_lora_adapters | {"mlp": third}
    prompt = PROMPTS[5]  # several full blocks for the prefix cache
    base = generate(llm, [prompt], [None])[0].outputs[0].token_ids
    assert llm.engine.model.lora_slots.state.rank == 16  # vLLM's default with enable_lora
    llm.load_lora("all", adapters["all"])
    llm.load_lora("qv", adapters["qv"])
    prompts, names = [prompt, *PROMPTS[1:3], prompt], ["all", "qv", None, "qv"]
    got = [o.outputs[0].token_ids for o in generate(llm, prompts, names)]
    assert got == expected(tiny_llama_dir, adapters, prompts, names)
    assert got[0] != base and got[3] != base
    with pytest.raises(LoRAError, match="all 2 LoRA adapter slots"):
        llm.load_lora("mlp", third)
    with pytest.raises(LoRAError, match="'qv' has already been loaded"):
        llm.load_lora("qv", adapters["qv"])

    llm.unload_lora("all")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'all'"):
        generate(llm, [prompt], ["all"])
    llm.load_lora("mlp", third)  # into the slot "all" held
    assert llm.engine.model.lora_slots.names == ["mlp", "qv"]
    mlp = generate(llm, [prompt], ["mlp"])[0]
    assert mlp.num_cached_tokens == 0  # not the blocks "all" cached in this slot
    assert mlp.outputs[0].token_ids == expected(tiny_llama_dir, adapters, [prompt], ["mlp"])[0]
    assert generate(llm, [prompt], ["mlp"])[0].num_cached_tokens > 0
    stats = llm.engine.get_stats().lora_adapters
    assert [(a.name, a.path) for a in stats] == [("qv", adapters["qv"]), ("mlp", third)]


def test_a_slot_frees_only_when_its_requests_are_done(tiny_llama_dir, tiny_lora_adapters, third):
    llm = LLM(tiny_llama_dir, enable_lora=True, max_loras=1, **CONFIG)
    engine = llm.engine
    llm.load_lora("all", tiny_lora_adapters["all"])
    prompt_ids = llm.tokenizer.encode(PROMPTS[2])
    engine.add_request("r", prompt_ids, greedy("all"))
    outputs = engine.step()  # prefill: the request runs on "all"
    llm.unload_lora("all")
    with pytest.raises(LoRAError, match="hold adapters or their requests"):
        llm.load_lora("mlp", third)
    while engine.has_unfinished_requests():
        outputs += engine.step()
    tokens = [t for o in outputs for t in o.new_token_ids]
    want = expected(tiny_llama_dir, tiny_lora_adapters, [PROMPTS[2]], ["all"])[0]
    assert tokens == want  # it finished on the adapter it started with
    llm.load_lora("mlp", third)
    assert engine.lora_index("mlp") == 0


def test_what_cannot_load_is_refused_and_leaves_the_slot_free(
    tmp_path, tiny_llama_dir, tiny_lora_adapters
):
    llm = LLM(tiny_llama_dir, enable_lora=True, max_lora_rank=4, **CONFIG)
    with pytest.raises(LoRAError, match="rank 8, above --max-lora-rank 4"):
        llm.load_lora("all", tiny_lora_adapters["all"])
    with pytest.raises(LoRAError, match="cannot read its adapter_config.json"):
        llm.load_lora("x", str(tmp_path / "missing"))
    head = build_lora(tiny_llama_dir, tmp_path / "head", 3, r=4, target_modules=["lm_head"])
    with pytest.raises(LoRAError, match="lm_head"):
        llm.load_lora("head", head)
    llm.load_lora("qv", tiny_lora_adapters["qv"])  # the one slot is still free
    got = generate(llm, PROMPTS[1:2], ["qv"])[0].outputs[0].token_ids
    assert got == expected(tiny_llama_dir, tiny_lora_adapters, PROMPTS[1:2], ["qv"])[0]
    with pytest.raises(ValueError, match="unknown LoRA adapter 'all'"):
        llm.unload_lora("all")

    static = LLM(tiny_llama_dir, lora_modules={"qv": tiny_lora_adapters["qv"]}, **CONFIG)
    with pytest.raises(LoRAError, match="only with --enable-lora"):
        static.load_lora("all", tiny_lora_adapters["all"])
    plain = LLM(tiny_llama_dir, **CONFIG)
    with pytest.raises(LoRAError, match="only with --enable-lora"):
        plain.load_lora("all", tiny_lora_adapters["all"])
    with pytest.raises(ValueError, match="max_loras 1 holds fewer adapters than the 2"):
        LLM(tiny_llama_dir, lora_modules=tiny_lora_adapters, max_loras=1, **CONFIG)


def test_sampling_params_name_no_adapter_without_lora(tiny_llama_dir):
    plain = LLM(tiny_llama_dir, **CONFIG)
    with pytest.raises(ValueError, match="unknown LoRA adapter 'a' \\(loaded: none\\)"):
        plain.generate(["hi"], SamplingParams(max_tokens=2, lora_name="a"), use_tqdm=False)


def test_lora_requests_load_their_adapters_as_vllms_offline_api(
    tiny_llama_dir, tiny_lora_adapters, third
):
    """vLLM's `generate(..., lora_request=LoRARequest(name, id, path))`: the adapter
    loads on first use, and one that no longer fits displaces the least recently
    requested; adapters loaded otherwise stay."""
    llm = LLM(tiny_llama_dir, enable_lora=True, max_loras=2, **CONFIG)
    llm.load_lora("qv", tiny_lora_adapters["qv"])
    adapters = tiny_lora_adapters | {"mlp": third}
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)

    def tokens(prompts, requests) -> list[list[int]]:
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
        return [o.outputs[0].token_ids for o in outs]

    prompts = PROMPTS[1:3]
    all_ = LoRARequest("all", 1, adapters["all"])
    assert tokens(prompts, all_) == expected(tiny_llama_dir, adapters, prompts, ["all"] * 2)
    mlp, qv = LoRARequest("mlp", 2, third), LoRARequest("qv", 3, adapters["qv"])
    got = tokens(prompts, [mlp, qv])  # "all" makes room for "mlp"; "qv" is already there
    assert got == expected(tiny_llama_dir, adapters, prompts, ["mlp", "qv"])
    assert sorted(a.name for a in llm.engine.get_stats().lora_adapters) == ["mlp", "qv"]
    with pytest.raises(LoRAError, match="all 2 LoRA adapter slots"):
        tokens(prompts, [all_, mlp])  # "qv" was not loaded by a request: it stays
    with pytest.raises(ValueError, match="'mlp' is loaded from"):
        tokens(prompts[:1], LoRARequest("mlp", 2, adapters["qv"]))
    with pytest.raises(ValueError, match="2 prompts but 1 LoRA requests"):
        tokens(prompts, [mlp])


def test_stats_name_the_adapters_running_and_waiting(tiny_llama_dir, tiny_lora_adapters):
    llm = LLM(tiny_llama_dir, enable_lora=True, max_loras=2, **(CONFIG | {"max_num_seqs": 1}))
    llm.load_lora("all", tiny_lora_adapters["all"])
    llm.load_lora("qv", tiny_lora_adapters["qv"])
    engine, ids = llm.engine, llm.tokenizer.encode(PROMPTS[2])
    for name, adapter in (("a", "qv"), ("b", "all"), ("c", None), ("d", "qv")):
        engine.add_request(name, ids, greedy(adapter))
    engine.step()  # one sequence at a time: "a" runs, the rest wait
    stats = engine.get_stats()
    assert (stats.lora_running, stats.lora_waiting, stats.max_loras) == (("qv",), ("all", "qv"), 2)
    llm.unload_lora("qv")  # "a" and "d", admitted on it, finish on it: no longer named
    stats = engine.get_stats()
    assert (stats.lora_running, stats.lora_waiting) == ((), ("all",))
    assert LLM(tiny_llama_dir, **CONFIG).engine.get_stats().max_loras == 0


def test_load_inplace_gives_a_name_new_weights(tiny_llama_dir, tiny_lora_adapters):
    llm = LLM(tiny_llama_dir, enable_lora=True, max_loras=1, **CONFIG)
    engine, adapters = llm.engine, tiny_lora_adapters
    prompt = PROMPTS[5]  # several full blocks for the prefix cache

    def want(adapter: str) -> list[int]:
        return expected(tiny_llama_dir, adapters, [prompt], [adapter])[0]

    llm.load_lora("x", adapters["all"])
    assert generate(llm, [prompt], ["x"])[0].outputs[0].token_ids == want("all")
    with pytest.raises(LoRAError, match="already been loaded"):
        llm.load_lora("x", adapters["qv"])
    llm.load_lora("x", adapters["qv"], load_inplace=True)  # its own slot, free
    out = generate(llm, [prompt], ["x"])[0]
    assert out.outputs[0].token_ids == want("qv") and out.num_cached_tokens == 0
    # A request still on the old weights holds the one slot: refused, "x" unchanged.
    engine.add_request("r", llm.tokenizer.encode(prompt), greedy("x"))
    engine.step()
    with pytest.raises(LoRAError, match="hold adapters or their requests"):
        llm.load_lora("x", adapters["all"], load_inplace=True)
    while engine.has_unfinished_requests():
        engine.step()
    assert [(a.name, a.path) for a in engine.get_stats().lora_adapters] == [("x", adapters["qv"])]


def test_load_inplace_beside_running_requests_takes_another_slot(
    tiny_llama_dir, tiny_lora_adapters
):
    llm = LLM(tiny_llama_dir, enable_lora=True, max_loras=2, **CONFIG)
    engine, adapters = llm.engine, tiny_lora_adapters
    llm.load_lora("x", adapters["all"])
    engine.add_request("old", llm.tokenizer.encode(PROMPTS[2]), greedy("x"))
    outputs = engine.step()
    llm.load_lora("x", adapters["qv"], load_inplace=True)
    assert engine.model.lora_slots.names == [None, "x"]
    engine.add_request("new", llm.tokenizer.encode(PROMPTS[1]), greedy("x"))
    while engine.has_unfinished_requests():
        outputs += engine.step()

    def tokens(request_id: str) -> list[int]:
        return [t for o in outputs if o.request_id == request_id for t in o.new_token_ids]

    assert tokens("old") == expected(tiny_llama_dir, adapters, PROMPTS[2:3], ["all"])[0]
    assert tokens("new") == expected(tiny_llama_dir, adapters, PROMPTS[1:2], ["qv"])[0]
