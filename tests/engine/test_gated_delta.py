"""The gated delta rule's two forms against each other, its convolution's, and what a
model with recurrent layers turns off (Qwen 3.5's exactness: test_models_exactness.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.models.gated_delta import CHUNK, causal_conv, chunked_rule
from engine.models.loader import load_tokenizer
from kernels.conv_step import conv_step
from kernels.gated_delta import l2_normalize, recurrent_step
from tests.reference import PROMPTS, hf_greedy


def rule_inputs(heads: int, tokens: int, k_dim: int, v_dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    f64 = dict(generator=gen, dtype=torch.float64)
    q = l2_normalize(torch.randn(heads, tokens, k_dim, **f64)) * k_dim**-0.5
    k = l2_normalize(torch.randn(heads, tokens, k_dim, **f64))
    v = torch.randn(heads, tokens, v_dim, **f64)
    g = -torch.rand(heads, tokens, **f64)  # decays in (e^-1, 1]
    beta = torch.rand(heads, tokens, **f64)
    state = torch.randn(heads, k_dim, v_dim, **f64)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("tokens", [1, 5, CHUNK, 2 * CHUNK + 22])
def test_chunks_equal_the_recurrence_token_by_token(tokens):
    """Over several chunks (the last one padded), from a state already written."""
    q, k, v, g, beta, state = rule_inputs(heads=3, tokens=tokens, k_dim=16, v_dim=8)
    out, final = chunked_rule(q, k, v, g, beta, state)
    want, s = [], state[None]
    for t in range(tokens):
        o, s = recurrent_step(q[None, :, t], k[None, :, t], v[None, :, t], g[None, :, t], beta[None, :, t], s)  # fmt: skip
        want.append(o[0])
    torch.testing.assert_close(out, torch.stack(want, dim=1))
    torch.testing.assert_close(final, s[0])


def test_a_prompt_in_parts_carries_its_state():
    """Two calls, the second from the first's state, give what one call gives."""
    q, k, v, g, beta, state = rule_inputs(heads=2, tokens=90, k_dim=8, v_dim=8, seed=1)
    whole, final = chunked_rule(q, k, v, g, beta, state)
    cut = 70
    first, mid = chunked_rule(*(t[:, :cut] for t in (q, k, v, g, beta)), state)
    second, end = chunked_rule(*(t[:, cut:] for t in (q, k, v, g, beta)), mid)
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole)
    torch.testing.assert_close(end, final)


def test_sequences_padded_together_equal_each_alone():
    """A batch of two: the shorter padded with tokens of no decay and no write."""
    long = rule_inputs(heads=2, tokens=90, k_dim=8, v_dim=8, seed=2)
    short = rule_inputs(heads=2, tokens=30, k_dim=8, v_dim=8, seed=3)
    padded = [F.pad(t, (0, 0, 0, 60)) for t in short[:3]] + [F.pad(t, (0, 60)) for t in short[3:5]]
    batch = [torch.stack([a, b]) for a, b in zip(long[:5], padded)]
    out, final = chunked_rule(*batch, torch.stack([long[5], short[5]]))
    for i, inputs in enumerate((long, short)):
        alone, alone_final = chunked_rule(*inputs)
        torch.testing.assert_close(out[i, :, : alone.shape[1]], alone)
        torch.testing.assert_close(final[i], alone_final)


def test_convolution_in_parts_by_step_and_padded_equals_the_whole():
    gen = torch.Generator().manual_seed(2)
    channels, kernel, tokens = 6, 4, 11
    x = torch.randn(1, tokens, channels, generator=gen, dtype=torch.float64)
    weight = torch.randn(channels, kernel, generator=gen, dtype=torch.float64)
    empty = torch.zeros(1, channels, kernel - 1, dtype=torch.float64)

    def conv(rows, state):
        return causal_conv(rows, state, weight, torch.tensor([rows.shape[1]]))

    whole, state = conv(x, empty)
    # Zero rows before the first token: token 0 sees only itself.
    torch.testing.assert_close(whole[0, 0], torch.nn.functional.silu(x[0, 0] * weight[:, -1]))
    head, mid = conv(x[:, :2], empty)
    tail, end = conv(x[:, 2:], mid)
    torch.testing.assert_close(torch.cat([head, tail], dim=1), whole)
    torch.testing.assert_close(end, state)
    s, steps = empty, []
    for t in range(tokens):
        out, s = conv_step(x[:, t], s, weight)
        steps.append(out)
    torch.testing.assert_close(torch.stack(steps, dim=1), whole)
    torch.testing.assert_close(s, state)
    # Beside a longer sequence, padded with zero rows: its rows and state are its own.
    both = torch.cat([F.pad(x[:, :5], (0, 0, 0, 6)), x])
    padded, states = causal_conv(both, empty.expand(2, -1, -1), weight, torch.tensor([5, 11]))
    alone, alone_state = conv(x[:, :5], empty)
    torch.testing.assert_close(padded[:1, :5], alone)
    torch.testing.assert_close(states[:1], alone_state)
    torch.testing.assert_close(padded[1:], whole)
    torch.testing.assert_close(states[1:], state)


def test_a_recurrent_model_runs_without_prefix_cache_or_speculation(tiny_family_dir):
    model_dir = tiny_family_dir("qwen3_5")
    llm = LLM(model_dir, device="cpu")
    config = llm.engine.config
    assert not config.enable_prefix_caching
    assert llm.engine.runner.walk_limit == 0  # off CUDA: prompts chunked, shapes on the host
    with pytest.raises(ValueError, match="speculative decoding is not supported"):
        LLM(model_dir, device="cpu", num_speculative_tokens=2)


def test_a_one_token_prompt_in_a_reused_slot_starts_from_zeros(tiny_family_dir):
    """Two slots: the short request's slot goes to a one-token prompt while the long one
    decodes, so that prompt's first step is a decode row of a decode-only step (its
    slot's states are the short request's until the step zeroes them)."""
    model_dir = tiny_family_dir("qwen3_5")
    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer.encode(PROMPTS[3]), tokenizer.encode(PROMPTS[5]), [17]]
    lengths = [20, 2, 8]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    llm = LLM(model_dir, device="cpu", max_num_seqs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    want = [hf_greedy(model_dir, p, n) for p, n in zip(prompts, lengths)]
    assert [o.outputs[0].token_ids for o in outs] == want


def test_states_that_do_not_fit_are_refused_by_name(tiny_family_dir, monkeypatch):
    import engine.model_runner

    monkeypatch.setattr(engine.model_runner, "CPU_KV_CACHE_BYTES", 4096)
    with pytest.raises(ValueError, match="recurrent states of max_num_seqs=8 sequences need"):
        LLM(tiny_family_dir("qwen3_5"), device="cpu", max_num_seqs=8)
