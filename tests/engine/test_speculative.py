"""Speculative decoding by n-gram lookup: the drafts, the sampler's verdicts, and the
engine's tokens (greedy: token for token transformers'), CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.models.loader import load_tokenizer
from engine.request import Request
from engine.speculative import ngram_draft
from tests.engine.test_sampler import EOS, VOCAB, BatchSampler
from tests.reference import PROMPTS, hf_greedy

MAX_NEW = 96
SPEC = dict(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


def draft(tokens: list[int], low: int, high: int, k: int) -> list[int]:
    return ngram_draft(np.array(tokens, dtype=np.int64), low, high, k).tolist()


def test_ngram_draft_takes_the_longest_match_then_the_earliest():
    tokens = [9, 2, 5, 1, 2, 6, 1, 2]
    assert draft(tokens, 1, 2, 3) == [6, 1, 2]  # "1 2" first occurs at 3
    assert draft(tokens, 1, 1, 3) == [5, 1, 2]  # "2" first occurs at 1
    assert draft(tokens, 1, 2, 1) == [6]
    assert draft(tokens, 3, 3, 3) == []  # "6 1 2" occurs only at the end
    assert draft([4, 4, 4], 1, 5, 4) == [4]  # what follows "4 4", up to the end
    assert draft([4, 4, 4], 1, 1, 4) == [4, 4]
    assert draft([7], 1, 3, 4) == []


def greedy(max_tokens: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def test_speculation_turns_async_scheduling_off_and_sets_vllm_defaults():
    config = EngineConfig(num_speculative_tokens=3)
    assert not config.async_scheduling
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    config = EngineConfig(num_speculative_tokens=3, prompt_lookup_max=2)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 2)
    assert EngineConfig().async_scheduling
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(num_speculative_tokens=3, prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="non-negative"):
        EngineConfig(num_speculative_tokens=-1)


@pytest.fixture(scope="module")
def expected(tiny_model_dir) -> list[list[int]]:
    tokenizer = load_tokenizer(tiny_model_dir)
    return [hf_greedy(tiny_model_dir, tokenizer.encode(p), MAX_NEW) for p in PROMPTS]


@pytest.mark.parametrize(
    "config",
    [
        {},
        # Budgets that cut drafts short, blocks that fill mid-draft.
        dict(max_num_batched_tokens=7, block_size=4),
        # Too few blocks for everyone: the newest are preempted and recomputed.
        dict(block_size=4, num_kv_blocks=48, max_model_len=160),
    ],
    ids=["plain", "chunked", "preempted"],
)
def test_greedy_speculation_matches_transformers(tiny_model_dir, expected, config):
    llm = LLM(tiny_model_dir, device="cpu", **SPEC, **config)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.engine.get_stats()
    # Drafts were accepted (several tokens read from one step) and refused (KV rewritten).
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    if "num_kv_blocks" in config:
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_stops_and_limits_inside_accepted_drafts(tiny_gpt2_dir):
    """A stop id or a length limit among a step's accepted drafts ends the request there,
    as without speculation."""
    plain = LLM(tiny_gpt2_dir, device="cpu")
    spec = LLM(tiny_gpt2_dir, device="cpu", **SPEC)
    runs = plain.generate(PROMPTS, greedy(), use_tqdm=False)
    # Stop at a token that comes late in each run; cut others at odd lengths.
    params = [
        greedy(stop_token_ids=[run.outputs[0].token_ids[-7]])
        if i % 2
        else greedy(max_tokens=MAX_NEW - 3 * i - 1)
        for i, run in enumerate(runs)
    ]
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
        assert g.outputs[0].text == w.outputs[0].text
    assert spec.engine.get_stats().spec_decode_num_accepted_tokens > 0
    assert spec.engine.batch.num_unscheduled == 0  # no read booked a token to a left row


def test_a_stop_before_more_accepted_tokens_ends_the_request_there(tiny_gpt2_dir):
    """The step's tokens after a stop are nobody's: the reads skip its row."""
    spec = LLM(tiny_gpt2_dir, device="cpu", **SPEC)
    engine = spec.engine
    verify, steps = engine.speculator.verify, []

    def recording(logits, out, argmax):
        verified = verify(logits, out, argmax)
        for slot, accepted in zip(out.sampling_slots.tolist(), verified.num_accepted.tolist()):
            req = engine.batch.requests[slot]
            steps.append((req.request_id, req.num_output_tokens, accepted))
        return verified

    engine.speculator.verify = recording
    prompts = {o.request_id: o.prompt for o in spec.generate(PROMPTS, greedy(), use_tqdm=False)}
    engine.speculator.verify = verify
    # The first token of a step that accepted a draft ends a stop string (the shortest
    # end of the text so far that occurs nowhere before).
    request_id, before, _ = next(step for step in steps if step[2])
    prompt = prompts[request_id]
    plain = LLM(tiny_gpt2_dir, device="cpu")
    text = plain.generate([prompt], greedy(before + 1), use_tqdm=False)[0].outputs[0].text
    stop = next(text[-m:] for m in range(1, len(text) + 1) if text.find(text[-m:]) == len(text) - m)
    params = greedy(stop=[stop])
    got = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert (got.token_ids, got.text) == (want.token_ids, want.text)
    assert got.finish_reason == want.finish_reason == "stop"
    assert engine.batch.num_unscheduled == 0


def test_rows_that_do_not_draft_share_the_batch(tiny_gpt2_dir):
    """Seeded rows sample one token a step beside drafting rows (penalty and logprob
    rows among them), and every row gives what it gives without speculation."""
    params = [
        greedy(),
        greedy(repetition_penalty=1.3, presence_penalty=0.5),
        greedy(logprobs=2),
        SamplingParams(max_tokens=MAX_NEW, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=MAX_NEW, temperature=0.8, min_p=0.05, ignore_eos=True),
    ]
    prompts = PROMPTS[: len(params)]
    plain = LLM(tiny_gpt2_dir, device="cpu").generate(prompts, params, use_tqdm=False)
    spec_llm = LLM(tiny_gpt2_dir, device="cpu", **SPEC)
    spec = spec_llm.generate(prompts, params, use_tqdm=False)
    for i in range(4):  # the random unseeded row draws differently
        assert spec[i].outputs[0].token_ids == plain[i].outputs[0].token_ids
    got, want = spec[2].outputs[0].logprobs, plain[2].outputs[0].logprobs
    assert [e.logprob for e in got] == pytest.approx([e.logprob for e in want], abs=1e-4)
    assert len(spec[4].outputs[0].token_ids) == MAX_NEW
    assert spec_llm.engine.get_stats().spec_decode_num_accepted_tokens > 0


def test_logit_bias_rows_draft_and_give_what_they_give_without_speculation(tiny_gpt2_dir):
    """logit_bias is the same at every position: a biased greedy row drafts, and its
    tokens are those of the run without speculation."""
    plain = LLM(tiny_gpt2_dir, device="cpu")
    first = plain.generate(PROMPTS[0], greedy(), use_tqdm=False)[0].outputs[0].token_ids
    banned = greedy(logit_bias={first[0]: -100.0, first[1]: 5.0})
    want = plain.generate(PROMPTS[0], banned, use_tqdm=False)[0].outputs[0].token_ids
    assert want != first and first[0] not in want  # the bias changes the output
    assert banned.speculates
    spec = LLM(tiny_gpt2_dir, device="cpu", **SPEC)
    got = spec.generate(PROMPTS[0], banned, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    assert spec.engine.get_stats().spec_decode_num_accepted_tokens > 0


def test_logprob_rows_draft_and_each_token_has_its_own_logprobs(tiny_gpt2_dir):
    """A drafting row's tokens each get the logprobs of their own position (its row of
    the verify step's logits): the same as without speculation, alternatives too."""
    params = [greedy(logprobs=3), greedy(logprobs=0)]
    prompts = PROMPTS[:2]
    want = LLM(tiny_gpt2_dir, device="cpu").generate(prompts, params, use_tqdm=False)
    spec = LLM(tiny_gpt2_dir, device="cpu", **SPEC)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert spec.engine.get_stats().spec_decode_num_accepted_tokens > 0
    for g, w in zip(got, want, strict=True):
        g, w = g.outputs[0], w.outputs[0]
        assert g.token_ids == w.token_ids and len(g.logprobs) == len(w.logprobs) == MAX_NEW
        for a, b in zip(g.logprobs, w.logprobs, strict=True):
            assert (a.token_id, a.rank, [t for t, _ in a.top]) == (
                b.token_id,
                b.rank,
                [t for t, _ in b.top],
            )
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)


@pytest.mark.parametrize(
    "options",
    [dict(repetition_penalty=1.3), dict(presence_penalty=0.4, frequency_penalty=0.3), None],
)
def test_penalty_and_min_tokens_rows_draft_and_count_the_drafts_before_them(tiny_gpt2_dir, options):
    """A draft's row counts the drafts before it as generated tokens, as the step at its
    position would: greedy output equals the run without speculation. min_tokens: a
    token the model repeats stops the request, banned until the 40th token."""
    plain = LLM(tiny_gpt2_dir, device="cpu")
    if options is None:
        first = plain.generate(PROMPTS[:3], greedy(), use_tqdm=False)
        repeated = [max(set(ids), key=ids.count) for ids in (o.outputs[0].token_ids for o in first)]
        options = dict(stop_token_ids=repeated, min_tokens=40)
    params = greedy(**options)
    assert params.speculates
    want = plain.generate(PROMPTS[:3], params, use_tqdm=False)
    spec = LLM(tiny_gpt2_dir, device="cpu", **SPEC)
    got = spec.generate(PROMPTS[:3], params, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert spec.engine.get_stats().spec_decode_num_accepted_tokens > 0
    if "min_tokens" in options:  # the stops came after the ban, not at MAX_NEW
        assert all(40 <= len(w.outputs[0].token_ids) < MAX_NEW for w in want)


def test_bad_words_and_allowed_token_ids_rows_draft_alike(tiny_gpt2_dir):
    """Bans and the allowed set hold at every draft's row, a word's earlier tokens
    counted among the drafts before it: greedy output equals the run without
    speculation."""
    plain = LLM(tiny_gpt2_dir, device="cpu")
    first = [o.outputs[0].token_ids for o in plain.generate(PROMPTS[:3], greedy(), use_tqdm=False)]
    words = [plain.tokenizer.decode(ids[4:6]) for ids in first]
    allowed = sorted({t for ids in first for t in ids[:40]})
    params = [
        greedy(bad_words=words),
        greedy(allowed_token_ids=allowed[::2]),
        greedy(bad_words=words),
    ]
    want = plain.generate(PROMPTS[:3], params, use_tqdm=False)
    assert [w.outputs[0].token_ids for w in want] != first
    spec = LLM(tiny_gpt2_dir, device="cpu", **SPEC)
    got = spec.generate(PROMPTS[:3], params, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert spec.engine.get_stats().spec_decode_num_accepted_tokens > 0


@pytest.fixture
def sampler() -> BatchSampler:
    return BatchSampler(torch.device("cpu"), seed=0)


def test_a_greedy_row_accepts_exactly_its_argmax(sampler):
    req = Request("g", [1], SamplingParams(temperature=0.0))
    logits = torch.randn(4, VOCAB)
    best = logits.argmax(-1)
    drafts = np.array([best[0].item(), (best[1].item() + 1) % VOCAB, best[2].item(), -1])
    slots = sampler.slots([req]).repeat(4)
    ids, accepted = sampler.sampler.verify(logits, slots, drafts, np.arange(4))
    assert ids.tolist() == best.tolist()
    assert accepted is None  # the caller compares: a greedy row's draft stands if it is its id
    # Beside a random row, the device compares.
    rand = Request("r", [1], SamplingParams(temperature=1.0))
    slots = np.concatenate([slots, sampler.slots([rand])])
    logits = torch.cat([logits, torch.randn(1, VOCAB)])
    ids, accepted = sampler.sampler.verify(logits, slots, np.append(drafts, -1), np.r_[0:4, 0])
    assert ids[:4].tolist() == best.tolist()
    assert accepted.tolist() == [True, False, True, False, False]


def test_a_rows_penalties_and_min_tokens_count_the_drafts_before_it(sampler):
    """Row j of a sequence is its position j: the drafts of rows 0..j-1 are generated
    tokens there, for penalties and for min_tokens."""
    penalized = Request("p", [1], SamplingParams(temperature=0.0, frequency_penalty=2.0))
    logits = torch.zeros(3, VOCAB)
    logits[:, 5], logits[:, 6] = 1.5, 0.5
    slots = sampler.slots([penalized]).repeat(3)
    ids, _ = sampler.sampler.verify(logits, slots, np.array([5, 5, -1]), np.arange(3))
    assert ids.tolist() == [5, 6, 6]  # once 5 is drafted before a row, 1.5 - 2 < 0.5
    banned = Request("m", [1], SamplingParams(temperature=0.0, min_tokens=2))
    logits = torch.zeros(3, VOCAB)
    logits[:, EOS], logits[:, 7] = 2.0, 1.0
    slots = sampler.slots([banned]).repeat(3)
    ids, _ = sampler.sampler.verify(logits, slots, np.array([7, 7, -1]), np.arange(3))
    assert ids.tolist() == [7, 7, EOS]  # EOS is banned at positions 0 and 1 only


def test_a_bad_words_earlier_tokens_may_be_drafts_before_the_row(sampler):
    """A two-token word is banned at its last token where its first is the draft of the
    row before (or the last output token), and nowhere else."""
    params = SamplingParams(temperature=0.0, bad_words=["x"], bad_words_token_ids=[[5, 6]])
    req = Request("b", [1], params)
    logits = torch.zeros(3, VOCAB)
    logits[:, 6], logits[:, 7] = 2.0, 1.0
    slots = sampler.slots([req]).repeat(3)
    ids, _ = sampler.sampler.verify(logits, slots, np.array([6, 5, -1]), np.arange(3))
    assert ids.tolist() == [6, 6, 7]  # row 2 follows the draft 5
    sampler.append(req, 5)
    ids, _ = sampler.sampler.verify(logits[:2], slots[:2], np.array([6, -1]), np.arange(2))
    assert ids.tolist() == [7, 6]  # row 0 follows the output's 5


@pytest.mark.parametrize(
    "knobs",
    [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, min_p=0.2)],
)
def test_a_random_row_keeps_the_models_distribution(sampler, knobs):
    """Accept the draft with probability p(draft), else sample p without it: the token
    that results is distributed as p, whatever the draft."""
    req = Request("r", [1], SamplingParams(**knobs))
    row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5] + [-30.0] * (VOCAB - 6))
    processed = sampler.process_logits(row[None], [req])
    p = sampler.sampler._probabilities(processed, [req], sampler.slots([req]))[0]
    p = (p / p.sum()).numpy()
    trials = 40_000
    slots = sampler.slots([req]).repeat(trials)
    for draft_id in (0, 2):
        logits = row.expand(trials, VOCAB).contiguous()
        drafts = np.full(trials, draft_id)
        ids, accepted = sampler.sampler.verify(logits, slots, drafts, np.zeros(trials, int))
        assert not (ids[~accepted] == draft_id).any()  # a refused draft is never resampled
        tokens = torch.where(accepted, torch.tensor(draft_id), ids).numpy()
        freq = np.bincount(tokens, minlength=VOCAB) / trials
        sigma = np.sqrt(p * (1 - p) / trials)
        assert np.all(np.abs(freq - p) <= 5 * sigma + 1e-9), (freq[:6], p[:6])


def test_two_ranks_verify_drafts_alike(tiny_llama_dir):
    """With tensor parallelism the other rank replays verify steps (a logits row per
    draft) from the driver's staged inputs."""
    tokenizer = load_tokenizer(tiny_llama_dir)
    want = [hf_greedy(tiny_llama_dir, tokenizer.encode(p), MAX_NEW) for p in PROMPTS[:4]]
    llm = LLM(tiny_llama_dir, device="cpu", tensor_parallel_size=2, block_size=4, **SPEC)
    try:
        outs = llm.generate(PROMPTS[:4], greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert llm.engine.get_stats().spec_decode_num_accepted_tokens > 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss", "mistral"])
def test_verify_rows_keep_windows_sinks_and_softcaps(tiny_family_dir, kind):
    """A verify step's tokens attend as decode rows of their own: each with its own
    sliding window (and GPT-OSS's sinks, Gemma 2's soft-cap)."""
    model_dir = tiny_family_dir(kind)
    tokenizer = load_tokenizer(model_dir)
    want = [hf_greedy(model_dir, tokenizer.encode(p), 48) for p in PROMPTS]
    llm = LLM(model_dir, device="cpu", **SPEC)
    outs = llm.generate(PROMPTS, greedy(48), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.engine.get_stats().spec_decode_num_accepted_tokens > 0


def test_arrivals_that_sample_plainly_stop_the_drafts_of_their_step(tiny_llama_dir):
    """An embedding, a prompt-logprobs and a grammar request admitted while the others
    draft: their step drafts nothing, and each gets what it gets without speculation."""
    from engine.structured.spec import GrammarSpec

    arrivals = {
        "emb": SamplingParams(max_tokens=1, temperature=0.0, pooling=True, detokenize=False),
        "scored": greedy(8, prompt_logprobs=2),
        "choice": SamplingParams(max_tokens=8, grammar=GrammarSpec.choice(["red", "blue"])),
    }

    def run(**config) -> tuple[dict, LLM]:
        llm = LLM(tiny_llama_dir, device="cpu", **config)
        engine, outputs = llm.engine, {}

        def step() -> None:
            for out in engine.step():
                if out.request_id in outputs:  # its deltas, summed into its first output
                    outputs[out.request_id].new_token_ids += out.new_token_ids
                    outputs[out.request_id].new_text += out.new_text
                    outputs[out.request_id].embedding = out.embedding
                else:
                    outputs[out.request_id] = out

        proposed: list[int] = []
        if engine.speculator:  # drafts every step: the last token again, K times
            engine.speculator.draft = lambda slot, tokens, k: tokens[-1:].repeat(k)
            propose = engine.speculator.propose
            engine.speculator.propose = lambda: (
                propose(),
                proposed.append(engine.batch.num_draft_tokens),
            )
        for i, prompt in enumerate(PROMPTS[:3]):
            engine.add_request(f"gen{i}", llm.tokenizer.encode(prompt), greedy(48))
        for _ in range(3):
            step()
        for name, params in arrivals.items():
            engine.add_request(name, llm.tokenizer.encode(PROMPTS[4]), params)
        step()
        if engine.speculator:  # proposed, then dropped when the arrivals were admitted
            assert proposed[-1] and not engine.batch.num_draft_tokens
        while engine.has_unfinished_requests():
            step()
        return outputs, llm

    want, _ = run()
    got, llm = run(**SPEC)
    assert llm.engine.get_stats().spec_decode_num_draft_tokens > 0
    np.testing.assert_allclose(got["emb"].embedding, want["emb"].embedding, atol=1e-5)
    assert [e and e.logprob for e in got["scored"].prompt_logprobs] == pytest.approx(
        [e and e.logprob for e in want["scored"].prompt_logprobs], abs=1e-5
    )
    assert got["choice"].new_text in ("red", "blue")
    for name in ("gen0", "gen1", "gen2", "scored"):
        assert got[name].new_token_ids == want[name].new_token_ids
