"""Sampling semantics through the whole engine: seeds, n, logprobs, stops, streaming text."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import LLM, SamplingParams
from engine.bad_words import bad_words_token_ids
from tests.reference import hf_greedy

EMOJI_CJK = ["Emoji: 😀 🚀 🌸", "中文：你好，世界！", "日本語：こんにちは世界。", "café 🔥 中文"]


@pytest.fixture(scope="module")
def llm(tiny_gpt2_dir) -> LLM:
    return LLM(tiny_gpt2_dir, device="cpu", block_size=4)


def texts(outs) -> list[str]:
    return [c.text for o in outs for c in o.outputs]


def test_seeded_sampling_is_reproducible_across_batch_mixes(llm):
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    alone = texts(llm.generate("Hello", seeded, use_tqdm=False))
    mixed = llm.generate(
        ["Once upon", "Hello", "1 2 3", "Hello"],
        [
            SamplingParams(max_tokens=8, temperature=0.9),
            seeded,
            SamplingParams(max_tokens=5, temperature=0.0),
            SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True),
        ],
        use_tqdm=False,
    )
    assert mixed[1].outputs[0].text == alone[0]
    assert mixed[3].outputs[0].text != alone[0]  # another seed, another sample


def test_temperature_zero_equals_greedy_and_top_k_one(llm):
    prompts = ["Hello", "The quick brown fox"]
    greedy = texts(
        llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0), use_tqdm=False)
    )
    top1 = texts(
        llm.generate(prompts, SamplingParams(max_tokens=10, top_k=1, seed=5), use_tqdm=False)
    )
    assert greedy == top1


def test_n_choices_share_the_prompt_blocks(llm):
    prompt = (
        "Continuous batching keeps the GPU busy: new requests join while others are still decoding."
    )
    engine = llm.engine
    hits_before = engine.blocks.prefix_hits
    out = llm.generate(
        prompt, SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=7), use_tqdm=False
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # seed + index differ
    full_blocks = (len(out.prompt_token_ids) - 1) // engine.config.block_size
    assert engine.blocks.prefix_hits - hits_before >= 2 * full_blocks * engine.config.block_size
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_logprobs_equal_log_softmax_of_transformers_logits(llm, tiny_gpt2_dir):
    from transformers import AutoModelForCausalLM

    prompt_ids = llm.tokenizer.encode("The quick brown fox")
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True)
    choice = llm.generate([prompt_ids], params, use_tqdm=False)[0].outputs[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + choice.token_ids])).logits[0]
    ref = logits.log_softmax(-1)[len(prompt_ids) - 1 : -1]  # the positions that chose each token
    assert len(choice.logprobs) == 4
    for i, (token_id, lp) in enumerate(zip(choice.token_ids, choice.logprobs)):
        assert lp.token_id == token_id and lp.rank == 1
        assert lp.logprob == pytest.approx(ref[i, token_id].item(), abs=1e-4)
        top_ids = ref[i].topk(3).indices.tolist()
        assert [t for t, _ in lp.top] == top_ids
        assert [v for _, v in lp.top] == pytest.approx(ref[i, top_ids].tolist(), abs=1e-4)


@pytest.mark.parametrize("prompt", EMOJI_CJK)
def test_streamed_deltas_concatenate_to_final_text(llm, prompt):
    engine = llm.engine
    ids = llm.tokenizer.encode(prompt)
    engine.add_request(
        "s", ids, SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True)
    )
    deltas, tokens = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.new_text)
            tokens += out.new_token_ids
    full = llm.tokenizer.decode(tokens, skip_special_tokens=True)
    assert "".join(deltas) == full
    if "\ufffd" not in full:  # random weights may emit byte soup that is not UTF-8
        assert all("\ufffd" not in d for d in deltas)


def test_stop_string_spanning_tokens_cuts_exactly(llm):
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    full = llm.generate("Hello", greedy, use_tqdm=False)[0].outputs[0]
    # Pick a stop string that straddles a token boundary in the greedy text.
    pieces = [llm.tokenizer.decode([t]) for t in full.token_ids]
    cut = len(pieces[0]) + len(pieces[1]) + len(pieces[2])
    stop = full.text[cut - 2 : cut + 2]
    assert len(stop) == 4
    before = full.text[: full.text.index(stop)]
    stopped = llm.generate(
        "Hello", SamplingParams(max_tokens=24, temperature=0.0, stop=[stop]), use_tqdm=False
    )
    choice = stopped[0].outputs[0]
    assert choice.text == before
    assert choice.finish_reason == "stop" and choice.stop_reason == stop
    kept = llm.generate(
        "Hello",
        SamplingParams(
            max_tokens=24, temperature=0.0, stop=[stop], include_stop_str_in_output=True
        ),
        use_tqdm=False,
    )
    assert kept[0].outputs[0].text == before + stop


def test_min_tokens_suppresses_eos(llm):
    eos = llm.tokenizer.eos_token_id
    # A logit bias makes EOS the certain choice; min_tokens must still hold it off.
    params = SamplingParams(max_tokens=10, temperature=0.0, logit_bias={eos: 100.0}, min_tokens=6)
    choice = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0]
    assert eos not in choice.token_ids[:6]
    assert choice.token_ids[6] == eos and len(choice.token_ids) == 7
    assert choice.finish_reason == "stop"


def test_stop_token_ids_end_the_request(llm):
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = llm.generate("Hello", greedy, use_tqdm=False)[0].outputs[0].token_ids
    stop_id = tokens[3]
    first = tokens.index(stop_id)
    params = SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]
    )
    choice = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0]
    assert choice.token_ids == tokens[: first + 1]
    assert choice.finish_reason == "stop" and choice.stop_reason == stop_id


def spellings(llm: LLM, word: str) -> list[list[int]]:
    return bad_words_token_ids([word], lambda t: llm.tokenizer.encode(t, add_special_tokens=False))


@pytest.mark.parametrize("span", [(1, 3), (3, 4)], ids=["two-token word", "one-token word"])
def test_bad_words_match_transformers_bad_words_ids(llm, tiny_gpt2_dir, span):
    """A word of the greedy output, banned: the output is transformers' with the word's
    spellings as bad_words_ids, and changes where the plain output spelled it."""
    ids = llm.tokenizer.encode("Hello")
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = llm.generate([ids], greedy, use_tqdm=False)[0].outputs[0].token_ids
    word = llm.tokenizer.decode(plain[span[0] : span[1]])
    banned = spellings(llm, word)
    assert plain[span[0] : span[1]] in banned  # the plain output spells the word
    params = dataclasses.replace(greedy, bad_words=[word])
    got = llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got[: span[1] - 1] == plain[: span[1] - 1] and got[span[1] - 1] != plain[span[1] - 1]
    assert got == hf_greedy(tiny_gpt2_dir, ids, 12, bad_words_ids=banned)


def test_allowed_token_ids_match_transformers_constrained_generation(llm, tiny_gpt2_dir):
    """Only the allowed ids come out: greedy equals transformers' generate constrained to
    them, and sampling draws from them alone."""
    ids = llm.tokenizer.encode("Hello")
    plain = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    allowed = sorted(set(plain[0].outputs[0].token_ids[1:5]) | {7, 100, 301})
    params = SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True, allowed_token_ids=allowed
    )
    got = llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got != plain[0].outputs[0].token_ids[:8]  # the first token was not allowed
    want = hf_greedy(tiny_gpt2_dir, ids, 8, prefix_allowed_tokens_fn=lambda _b, _ids: allowed)
    assert got == want
    sampled = dataclasses.replace(params, temperature=1.0, seed=3, max_tokens=40)
    out = llm.generate([ids], sampled, use_tqdm=False)[0].outputs[0].token_ids
    assert set(out) <= set(allowed) and len(set(out)) > 1
