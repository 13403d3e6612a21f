"""LoRA adapters on CUDA: a mixed batch in fp32 gives transformers + peft's tokens with
CUDA graphs on and off (the masks rebuilt by every replay from the staged adapter
ids); with FP8 projections the adapted ones read their inputs unquantized and agree
with the bf16 engine's adapter."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.loader import load_tokenizer
from engine.models.quantization import Fp8Linear
from kernels.fp8 import fp8_supported
from tests.gpu.on_cuda import GPU
from tests.reference import PROMPTS, peft_greedy

pytestmark = GPU
NEW = 16
NAMES = [None, "all", "qv", "all"]


def greedy(name: str | None, max_tokens: int = NEW, **kw) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, lora_name=name, **kw
    )


@pytest.mark.parametrize("graphs", [True, False])
def test_a_mixed_batch_matches_peft(tiny_llama_dir, tiny_lora_adapters, graphs: bool) -> None:
    llm = LLM(
        tiny_llama_dir,
        device="cuda",
        dtype="float32",
        max_num_seqs=16,
        lora_modules=tiny_lora_adapters,
        enforce_eager=not graphs,
    )
    prompts = PROMPTS[:8]
    names = [NAMES[i % len(NAMES)] for i in range(len(prompts))]
    outs = llm.generate(prompts, [greedy(n) for n in names], use_tqdm=False)
    tokenizer = load_tokenizer(tiny_llama_dir)
    for prompt, name, out in zip(prompts, names, outs):
        ids = tokenizer.encode(prompt)
        want = peft_greedy(tiny_llama_dir, tiny_lora_adapters.get(name), ids, NEW)
        assert out.outputs[0].token_ids == want, (prompt, name)
    assert (llm.engine.runner.steps_by_path["graph"] > 0) == graphs


@pytest.mark.skipif(
    not torch.cuda.is_available() or not fp8_supported(torch.device("cuda")),
    reason="needs FP8 (compute capability 8.9+)",
)
def test_fp8_projections_keep_their_adapters(tiny_llama_dir, tiny_lora_adapters) -> None:
    config = dict(device="cuda", dtype="bfloat16", max_num_seqs=16, lora_modules=tiny_lora_adapters)
    bf16 = LLM(tiny_llama_dir, **config)
    outs = bf16.generate(PROMPTS, greedy("all"), use_tqdm=False)
    seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    fp8 = LLM(tiny_llama_dir, quantization="fp8", **config)
    model = fp8.engine.model
    assert all(isinstance(layer.self_attn.qkv_proj, Fp8Linear) for layer in model.layers)
    assert all(layer.self_attn.qkv_proj.lora is not None for layer in model.layers)
    assert not any(layer.input_layernorm.fp8_out for layer in model.layers)
    # Teacher-forced on the bf16 adapter's tokens: mostly its top-1 (as FP8 without one).
    scored = fp8.generate(seqs, greedy("all", prompt_logprobs=0, max_tokens=1), use_tqdm=False)
    ranks = [
        o.prompt_logprobs[p].rank
        for o in scored
        for p in range(len(o.prompt_token_ids) - NEW, len(o.prompt_token_ids))
    ]
    assert sum(r == 1 for r in ranks) / len(ranks) >= 0.6
    # And the adapter matters there: the base model's agreement with it is lower.
    base = fp8.generate(seqs, greedy(None, prompt_logprobs=0, max_tokens=1), use_tqdm=False)
    base_ranks = [
        o.prompt_logprobs[p].rank
        for o in base
        for p in range(len(o.prompt_token_ids) - NEW, len(o.prompt_token_ids))
    ]
    assert sum(r == 1 for r in base_ranks) < sum(r == 1 for r in ranks)


def test_the_split_k_epilogue_adds_what_torch_adds(tiny_llama_dir, tiny_lora_adapters, monkeypatch):
    """bf16, prompts under 16 tokens: every projection takes the split-K kernel, whose
    epilogue adds the deltas; the torch path (cuBLAS, then the masked expand) scores the
    same prompts alike, and the adapters move the scores far more than the paths differ."""
    llm = LLM(tiny_llama_dir, device="cuda", dtype="bfloat16", lora_modules=tiny_lora_adapters)
    prompts = [p for p in PROMPTS if len(llm.tokenizer.encode(p)) <= 16]
    names = [NAMES[i % len(NAMES)] for i in range(len(prompts))]

    def scores(lora: str | None = None) -> torch.Tensor:
        params = [greedy(lora or n, max_tokens=1, prompt_logprobs=0) for n in names]
        outs = llm.generate(prompts, params, use_tqdm=False)
        return torch.tensor([e.logprob for o in outs for e in o.prompt_logprobs[1:]])

    epilogue = scores()
    monkeypatch.setattr("engine.models.lora.splitk_pays", lambda x, weight: False)
    in_torch = scores()
    # The epilogue adds the deltas to fp32 sums, torch to the bf16 product.
    assert (epilogue - in_torch).abs().max() < 0.25
    assert (scores("all") - in_torch).abs().max() > 1.0


def test_adapters_loaded_after_capture_match_peft(tiny_llama_dir, tiny_lora_adapters) -> None:
    """The decode graphs are captured over empty slots: loads write into them in place,
    and a slot's next adapter replaces all of the last one's rows."""
    llm = LLM(
        tiny_llama_dir,
        device="cuda",
        dtype="float32",
        max_num_seqs=16,
        enable_lora=True,
        max_loras=2,
    )
    llm.load_lora("all", tiny_lora_adapters["all"])
    llm.load_lora("qv", tiny_lora_adapters["qv"])
    llm.unload_lora("all")
    llm.load_lora("again", tiny_lora_adapters["qv"])  # qv's rows over all's, in slot 0
    adapters = {"qv": tiny_lora_adapters["qv"], "again": tiny_lora_adapters["qv"]}
    prompts = PROMPTS[:8]
    names = [[None, "qv", "again"][i % 3] for i in range(len(prompts))]
    outs = llm.generate(prompts, [greedy(n) for n in names], use_tqdm=False)
    tokenizer = load_tokenizer(tiny_llama_dir)
    for prompt, name, out in zip(prompts, names, outs):
        want = peft_greedy(tiny_llama_dir, adapters.get(name), tokenizer.encode(prompt), NEW)
        assert out.outputs[0].token_ids == want, (prompt, name)
    assert llm.engine.runner.steps_by_path["graph"] > 0


@pytest.mark.skipif(
    not torch.cuda.is_available() or not fp8_supported(torch.device("cuda")),
    reason="needs FP8 (compute capability 8.9+)",
)
def test_an_adapter_loaded_into_fp8_projections_is_the_startup_ones(
    tiny_llama_dir, tiny_lora_adapters
) -> None:
    """The projections are FP8 by the time an adapter loads: its rows are placed by the
    splits taken before the swap, as a startup adapter's."""
    config = dict(device="cuda", dtype="bfloat16", quantization="fp8", enable_lora=True)
    startup = LLM(tiny_llama_dir, lora_modules=tiny_lora_adapters, **config)
    loaded = LLM(tiny_llama_dir, max_loras=2, **config)
    loaded.load_lora("all", tiny_lora_adapters["all"])
    loaded.load_lora("qv", tiny_lora_adapters["qv"])
    names = [NAMES[i % len(NAMES)] for i in range(len(PROMPTS))]

    def tokens(llm: LLM) -> list[list[int]]:
        outs = llm.generate(PROMPTS, [greedy(n) for n in names], use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    assert tokens(loaded) == tokens(startup)
