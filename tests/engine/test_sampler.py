"""Sampler: greedy fast path, seeded reproducibility, masks, penalties, logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.input_batch import InputBatch
from engine.request import Request
from engine.sampler import Sampler, SamplerOutput, _apply_top_k_top_p
from engine.sampling_params import SamplingParams
from tests.introspection import OpLog

VOCAB = 32
EOS = 31


@pytest.fixture(
    params=[
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
            ],
        ),
    ]
)
def device(request) -> torch.device:
    return torch.device(request.param)


class BatchSampler:
    """A Sampler over an InputBatch of its own: requests join it on first use, as the
    scheduler admits them; append() books a sampled id as the engine's read does."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.batch = InputBatch(40000, 40, VOCAB)
        self.sampler = Sampler(VOCAB, device, seed, [EOS], self.batch)

    def slots(self, requests: list[Request]) -> np.ndarray:
        for req in requests:
            if req.batch is None:
                req.stop_ids = frozenset([EOS, *req.params.stop_token_ids])
                self.batch.add(req)
        return np.array([req.slot for req in requests], dtype=np.int64)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """Sample and read the results back."""
        slots = self.slots(requests)
        return self.sampler.read(logits, self.sampler.sample(logits, slots), slots)

    def process_logits(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        self.slots(requests)
        return self.sampler.process_logits(logits, requests)

    def append(self, req: Request, token_id: int) -> None:
        slot = np.array([req.slot])
        mark = self.batch.launched(slot)
        self.batch.read(slot, mark, np.array([token_id]))


def make_sampler(device: torch.device, seed: int = 0) -> BatchSampler:
    return BatchSampler(device, seed)


def make_request(
    prompt: list[int] | None = None, output: list[int] | None = None, **params
) -> Request:
    params.setdefault("max_tokens", 64)
    req = Request("r", prompt or [1, 2, 3], SamplingParams(**params))
    req.detach(list(output or []), 0, 0, 0)  # as a request preempted with these outputs
    return req


def step_logits(step: int, rows: int = 1) -> torch.Tensor:
    """Fixed, fairly flat logits for one decode step: [rows, VOCAB]."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, VOCAB, generator=g).mul(0.5)


# ---- greedy ----


def test_all_greedy_batch_is_one_argmax(device):
    logits = torch.randn(4, VOCAB, device=device)
    requests = [make_request(temperature=0.0) for _ in range(3)]
    requests.append(make_request(temperature=0.7, top_k=1))
    with OpLog() as log:
        out = make_sampler(device)(logits, requests)
    # One kernel, then the one device-to-host copy that .tolist() makes off the CPU.
    copy = [] if device.type == "cpu" else ["aten._to_copy.default"]
    assert log.ops == ["aten.argmax.default", *copy]
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 4


def test_greedy_with_half_precision_logits(device):
    logits = torch.randn(3, VOCAB, device=device).to(torch.bfloat16)
    requests = [
        make_request(temperature=0.0),
        make_request(temperature=0.0, logit_bias={5: 0.0}),
        make_request(temperature=0.0, logprobs=2),
    ]
    out = make_sampler(device)(logits, requests)
    assert out.token_ids == logits.float().argmax(-1).tolist()


def test_temperature_zero_is_argmax_in_a_mixed_batch(device):
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB, device=device)
    requests = [
        make_request(temperature=0.0),
        make_request(temperature=1.0),
        make_request(temperature=0.0, seed=3),
        make_request(temperature=1.3, seed=4, top_p=0.8),
        make_request(temperature=0.0, top_p=0.5, min_p=0.2),
        make_request(temperature=0.9, top_k=1),
    ]
    out = make_sampler(device)(logits, requests)
    argmax = logits.argmax(-1).tolist()
    for row in (0, 2, 4, 5):
        assert out.token_ids[row] == argmax[row]


def test_top_k_one_equals_greedy(device):
    sampler = make_sampler(device)
    for step in range(10):
        logits = step_logits(step, rows=2).to(device)
        requests = [make_request(temperature=1.0, top_k=1), make_request(temperature=1.5, top_k=1)]
        assert sampler(logits, requests).token_ids == logits.argmax(-1).tolist()


# ---- seeds ----


def generate(
    device: torch.device,
    target: Request,
    others: list[Request],
    position: int,
    engine_seed: int,
    steps: int = 24,
) -> list[int]:
    """Tokens `target` gets over `steps` steps, sampled in a batch with `others`."""
    sampler = make_sampler(device, engine_seed)
    tokens = []
    for step in range(steps):
        batch = list(others)
        batch.insert(position, target)
        logits = torch.cat([step_logits(step + 100 * i) for i in range(len(batch))])
        # The target's own row is the same every run, whatever surrounds it.
        logits[position] = step_logits(step)[0]
        out = sampler(logits.to(device), batch)
        tokens.append(out.token_ids[position])
        for req, token_id in zip(batch, out.token_ids, strict=True):
            sampler.append(req, token_id)
    return tokens


def test_seeded_request_is_reproducible_alone_and_in_any_batch(device):
    def target() -> Request:
        return make_request(temperature=1.0, top_p=0.95, seed=1234)

    alone = generate(device, target(), [], 0, engine_seed=0)
    assert len(set(alone)) > 3  # really sampled, not a constant

    mixes = [
        ([make_request(temperature=1.0)], 1, 7),
        ([make_request(temperature=1.0, seed=99), make_request(temperature=0.0)], 2, 1),
        (
            [
                make_request(temperature=0.5, top_k=5),
                make_request(temperature=0.0, logprobs=3),
                make_request(temperature=1.0, seed=5, presence_penalty=0.5),
            ],
            1,
            2,
        ),
    ]
    for others, position, engine_seed in mixes:
        assert generate(device, target(), others, position, engine_seed) == alone


def test_different_seeds_differ(device):
    a = generate(device, make_request(temperature=1.0, seed=1), [], 0, engine_seed=0)
    b = generate(device, make_request(temperature=1.0, seed=2), [], 0, engine_seed=0)
    assert a != b


def test_unseeded_rows_follow_the_engine_seed(device):
    def run(engine_seed: int) -> list[int]:
        return generate(device, make_request(temperature=1.0), [make_request()], 0, engine_seed)

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_seeded_generator_is_created_lazily_and_kept(device):
    req = make_request(temperature=1.0, seed=42)
    assert req.generator is None
    sampler = make_sampler(device)
    sampler(step_logits(0).to(device), [req])
    generator = req.generator
    assert generator is not None and generator.initial_seed() == 42
    sampler(step_logits(1).to(device), [req])
    assert req.generator is generator


# ---- top_k / top_p / min_p ----

# Distinct, well-spread logits so no mask boundary is a near tie.
MASK_LOGITS = torch.linspace(3.0, -3.0, VOCAB)[
    torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))
]

MASK_CASES = [
    dict(temperature=1.0),
    dict(temperature=1.0, top_k=5),
    dict(temperature=0.7, top_k=12),
    dict(temperature=1.0, top_p=0.5),
    dict(temperature=1.5, top_p=0.8),
    dict(temperature=1.0, min_p=0.3),
    dict(temperature=0.8, min_p=0.1),
    dict(temperature=1.0, top_k=10, top_p=0.6),
    dict(temperature=1.2, top_k=8, top_p=0.9, min_p=0.2),
]


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Plain one-row version: temperature, top_k, then top_p, then min_p. Returns [V]."""
    probs = (logits.double() / params.temperature).softmax(-1)
    order = probs.argsort(descending=True).tolist()
    keep = set(order[: params.top_k] if params.top_k else order)
    if params.top_p < 1.0:
        mass = sum(probs[i].item() for i in keep)
        nucleus, cumulative = set(), 0.0
        for i in order:
            if i in keep and cumulative < params.top_p:
                nucleus.add(i)
                cumulative += probs[i].item() / mass
        keep = nucleus
    masked = torch.tensor([probs[i].item() if i in keep else 0.0 for i in range(len(probs))])
    masked /= masked.sum()
    if params.min_p > 0.0:
        masked[masked < params.min_p * masked.max()] = 0.0
        masked /= masked.sum()
    return masked


# min_p is applied to probabilities after this mask, so its cases are left out here.
@pytest.mark.parametrize("case", [c for c in MASK_CASES if "min_p" not in c], ids=str)
def test_top_k_top_p_mask_keeps_the_reference_set(case):
    params = SamplingParams(**case)
    logits = (MASK_LOGITS / params.temperature).unsqueeze(0)
    top_k = torch.tensor([[float(params.top_k or VOCAB)]])
    top_p = torch.tensor([[params.top_p]])
    masked = _apply_top_k_top_p(logits.clone(), top_k, top_p)
    kept = set(torch.isfinite(masked[0]).nonzero().flatten().tolist())
    expected = set((reference_probs(MASK_LOGITS, params) > 0).nonzero().flatten().tolist())
    assert kept == expected
    # Surviving logits are untouched.
    assert torch.equal(masked[0][list(kept)], logits[0][list(kept)])


def test_masks_and_sampling_frequencies_match_the_reference(device):
    draws = 4000
    requests = [make_request(**case) for case in MASK_CASES for _ in range(draws)]
    logits = MASK_LOGITS.expand(len(requests), VOCAB).to(device)
    tokens = torch.tensor(make_sampler(device)(logits, requests).token_ids).view(
        len(MASK_CASES), draws
    )
    for case, row_tokens in zip(MASK_CASES, tokens, strict=True):
        expected = reference_probs(MASK_LOGITS, SamplingParams(**case))
        empirical = torch.bincount(row_tokens, minlength=VOCAB).double() / draws
        support = set(expected.nonzero().flatten().tolist())
        assert set(row_tokens.tolist()) <= support, case
        # 4000 draws: standard error of a frequency is at most 0.008.
        assert (empirical - expected).abs().max() < 0.035, case


# ---- penalties, logit_bias, min_tokens ----


def reference_processed(logits: torch.Tensor, req: Request, eos_ids: list[int]) -> torch.Tensor:
    """One row, the obvious way: bias, repetition, frequency/presence, min_tokens."""
    row = logits.double().clone()
    p = req.params
    for token_id, bias in (p.logit_bias or {}).items():
        row[token_id] += bias
    for token_id in set(req.prompt_token_ids) | set(req.output_token_ids):
        if row[token_id] > 0:
            row[token_id] /= p.repetition_penalty
        else:
            row[token_id] *= p.repetition_penalty
    for token_id in set(req.output_token_ids):
        count = req.output_token_ids.count(token_id)
        row[token_id] -= p.frequency_penalty * count + p.presence_penalty
    if req.num_output_tokens < p.min_tokens:
        for token_id in set(eos_ids) | set(p.stop_token_ids):
            row[token_id] = -math.inf
    return row


def test_penalties_bias_and_min_tokens_match_the_reference(device):
    torch.manual_seed(0)
    prompt = [1, 2, 2, 5, 9]
    output = [5, 7, 7, 7, 12, 1]
    requests = [
        make_request(prompt, output),
        make_request(prompt, output, repetition_penalty=1.3),
        make_request(prompt, output, repetition_penalty=0.8),
        make_request(prompt, output, frequency_penalty=0.7),
        make_request(prompt, output, presence_penalty=-1.5),
        make_request(prompt, output, frequency_penalty=-0.4, presence_penalty=1.1),
        make_request(prompt, [], repetition_penalty=1.5, frequency_penalty=2.0),
        make_request(prompt, output, logit_bias={3: 5.0, 7: -100.0, 0: 0.5}),
        make_request(
            prompt, output, logit_bias={7: 2.0}, repetition_penalty=1.2, presence_penalty=0.3
        ),
        make_request(prompt, output, min_tokens=10, stop_token_ids=[4, 8]),
        make_request(prompt, output, min_tokens=6, stop_token_ids=[4]),  # satisfied: no mask
    ]
    logits = torch.randn(len(requests), VOCAB) * 2
    processed = make_sampler(device).process_logits(logits.to(device), requests).cpu()
    for row, req in enumerate(requests):
        expected = reference_processed(logits[row], req, [EOS]).float()
        torch.testing.assert_close(processed[row], expected, msg=f"row {row}")
    # The caller's logits are never written.
    assert torch.isfinite(logits).all()


def test_penalized_greedy_row_takes_the_processed_argmax(device):
    logits = torch.zeros(1, VOCAB)
    logits[0, 4] = 3.0
    logits[0, 6] = 2.0
    req = make_request(output=[4, 4], temperature=0.0, frequency_penalty=1.0)
    assert make_sampler(device)(logits.to(device), [req]).token_ids == [6]


def test_min_tokens_suppresses_eos_and_stop_token_ids(device):
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, EOS] = 10.0
    logits[0, 9] = 9.0
    logits[0, 2] = 1.0
    sampler = make_sampler(device)
    for temperature in (0.0, 1.0):
        req = make_request(temperature=temperature, min_tokens=3, stop_token_ids=[9])
        for _ in range(3):
            token_id = sampler(logits.to(device), [req]).token_ids[0]
            assert token_id not in (EOS, 9)
            sampler.append(req, token_id)
    # Once min_tokens is reached, EOS is back.
    req = make_request(temperature=0.0, min_tokens=2, stop_token_ids=[9], output=[2, 2])
    assert sampler(logits.to(device), [req]).token_ids == [EOS]


def test_min_tokens_holds_under_many_random_draws(device):
    logits = torch.full((500, VOCAB), 0.0)
    logits[:, EOS] = 8.0
    requests = [make_request(temperature=1.0, min_tokens=1) for _ in range(500)]
    assert EOS not in make_sampler(device)(logits.to(device), requests).token_ids


# ---- logprobs ----


def test_logprobs_are_the_raw_log_softmax(device):
    torch.manual_seed(0)
    logits = torch.randn(5, VOCAB) * 3
    requests = [
        make_request(temperature=1.0, logprobs=5, seed=3),
        make_request(temperature=0.0),  # no logprobs
        make_request(temperature=0.0, logprobs=0),
        # Penalties and temperature do not touch the reported logprobs.
        make_request(output=[1, 1], temperature=0.5, logprobs=20, frequency_penalty=2.0),
        make_request(temperature=1.0, logprobs=1, top_k=3),
    ]
    out = make_sampler(device)(logits.to(device), requests)
    reference = logits.log_softmax(-1)
    assert out.logprobs[1] is None
    for row, k in ((0, 5), (2, 0), (3, 20), (4, 1)):
        lp = out.logprobs[row]
        token_id = out.token_ids[row]
        assert lp.token_id == token_id
        assert lp.logprob == pytest.approx(reference[row, token_id].item(), abs=1e-6)
        assert lp.rank == int((reference[row] > reference[row, token_id]).sum()) + 1
        best = reference[row].topk(k)
        assert [t for t, _ in lp.top] == best.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(best.values.tolist(), abs=1e-6)
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    assert out.logprobs[2].rank == 1 and out.logprobs[2].top == []


def test_logprobs_of_half_precision_logits_are_computed_in_fp32(device):
    logits = (torch.randn(2, VOCAB) * 4).to(torch.float16)
    requests = [make_request(temperature=0.0, logprobs=3) for _ in range(2)]
    out = make_sampler(device)(logits.to(device), requests)
    reference = logits.float().log_softmax(-1)
    for row in range(2):
        assert out.logprobs[row].logprob == pytest.approx(
            reference[row, out.token_ids[row]].item(), abs=1e-6
        )
