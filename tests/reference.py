"""What the engine's output is checked against: the test prompts, and transformers' (and
PEFT's) greedy continuations in fp32 on CPU."""

from __future__ import annotations

import torch

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "def forward(self, x):",
    "Once upon a time, in a land far away,",
    "1 2 3 4 5",
    "Continuous batching keeps the GPU busy: new requests join while others are still decoding.",
    "中文：你好，世界！",
    "Emoji: 😀 🚀",
    "A paged KV cache stores keys and values in fixed-size blocks",
]


def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    """transformers' greedy continuation in fp32 on CPU, EOS ignored (kwargs: to generate)."""
    model = hf_model(model_dir)
    input_ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return out[0, len(prompt_ids) :].tolist()


def hf_model(model_dir: str):
    """transformers' model of `model_dir` in fp32 on CPU, loaded once."""
    from transformers import AutoModelForCausalLM

    model = _hf_models.get(model_dir)
    if model is None:
        try:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        except ValueError:  # a class AutoModelForCausalLM does not map (Mistral 4's)
            import transformers

            config = transformers.AutoConfig.from_pretrained(model_dir)
            model_class = getattr(transformers, config.architectures[0])
            model = model_class.from_pretrained(model_dir, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # ignore EOS without masking it
        _hf_models[model_dir] = model
    return model


_hf_models: dict = {}


def peft_greedy(base_dir: str, adapter_dir: str | None, prompt_ids: list[int], n: int) -> list[int]:
    """transformers + peft's greedy continuation (fp32, CPU, EOS ignored); None: the base."""
    if adapter_dir is None:
        return hf_greedy(base_dir, prompt_ids, n)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = _hf_models.get(adapter_dir)
    if model is None:
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, adapter_dir).eval()
        model.generation_config.eos_token_id = None
        _hf_models[adapter_dir] = model
    input_ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


# The engine sums in other orders than transformers (its kernels on CUDA; on the CPU too,
# a MoE's experts): where transformers' two best logits are this close, either token is
# the greedy one.
NEAR_TIE = 1e-4


def assert_greedy_matches(
    model_dir: str, prompt_ids: list[list[int]], got: list[list[int]], want: list[list[int]]
) -> None:
    """Each of `got` equals transformers' `want`, or parts from it at a near-tie (the two
    tokens' logits, given what came before, within NEAR_TIE); what follows is not compared."""
    assert len(got) == len(want)
    for ids, ours, theirs in zip(prompt_ids, got, want, strict=True):
        assert len(ours) == len(theirs)
        parted = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if parted is None:
            continue
        with torch.no_grad():
            logits = hf_model(model_dir)(torch.tensor([ids + theirs[:parted]])).logits[0, -1]
        gap = float(logits[theirs[parted]] - logits[ours[parted]])
        assert gap <= NEAR_TIE, (
            f"token {parted}: {ours[parted]} where transformers takes {theirs[parted]}, "
            f"{gap:.2e} ahead: {ours} != {theirs}"
        )
