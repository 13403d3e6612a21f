"""use_beam_search (vLLM's): the n best beams equal a beam search run here over
transformers' logits with vLLM's rules; streamed whole; options it cannot honor are 400s."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch

from engine.request import RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from server.beam_search import search
from tests.server.test_surface import CHAT


def hf_beam_search(
    model_dir: str, prompt: list[int], width: int, max_tokens: int, eos: int, penalty: float = 1.0
) -> list[tuple[list[int], str, list[float]]]:
    """vLLM's beam search over transformers' fp32 logits: (tokens, finish reason, each
    token's logprob) of the `width` best beams, best first (EOS dropped from tokens)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return beam_search_over(
        lambda ids: model(torch.tensor([ids])).logits[0, -1],
        prompt,
        width,
        max_tokens,
        eos,
        penalty,
    )


def beam_search_over(
    next_logits, prompt: list[int], width: int, max_tokens: int, eos: int, penalty: float = 1.0
) -> list[tuple[list[int], str, list[float]]]:
    """vLLM's beam search over next_logits(ids) (a model's last-position logits)."""

    def score(beam) -> float:
        tokens, logprobs, stopped = beam
        return sum(logprobs) / (len(prompt) + len(tokens) - stopped) ** penalty

    live, done = [([], [], False)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, logprobs, _ in live:
            with torch.no_grad():
                logits = next_logits(prompt + tokens)
            top = logits.log_softmax(-1).topk(2 * width)
            for logprob, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                beam = (tokens + [token], logprobs + [logprob], token == eos)
                (done if token == eos else candidates).append(beam)
        live = sorted(candidates, key=score, reverse=True)[:width]
    best = sorted(done + live, key=score, reverse=True)[:width]
    return [
        (tokens[:-1] if stopped else tokens, "stop" if stopped else "length", logprobs)
        for tokens, logprobs, stopped in best
    ]


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer.encode("Once upon a time")


@pytest.mark.parametrize("penalty", [1.0, 0.3])
def test_completions_return_the_best_beams(client, tiny_gpt2_dir, tokenizer, prompt, penalty):
    want = hf_beam_search(tiny_gpt2_dir, prompt, 3, 6, tokenizer.eos_token_id, penalty)
    body = {"prompt": prompt, "n": 3, "max_tokens": 6, "use_beam_search": True}
    body |= {"length_penalty": penalty, "return_token_ids": True, "logprobs": 1}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert [(c["token_ids"], c["finish_reason"]) for c in choices] == [w[:2] for w in want]
    assert len({tuple(c["token_ids"]) for c in choices}) == 3  # three beams, not one
    for c, (tokens, _, logprobs) in zip(choices, want, strict=True):
        assert c["text"] == tokenizer.decode(tokens)
        assert c["logprobs"]["token_logprobs"] == pytest.approx(logprobs[: len(tokens)], abs=1e-4)
    assert r.json()["usage"]["completion_tokens"] == sum(len(w[0]) for w in want)


def test_chat_beams_streamed_whole(client, tiny_gpt2_dir, tokenizer):
    body = CHAT | {"n": 2, "max_tokens": 5, "use_beam_search": True, "return_token_ids": True}
    whole = client.post("/v1/chat/completions", json=body).json()["choices"]
    prompt = client.post("/tokenize", json={"messages": CHAT["messages"]}).json()["tokens"]
    want = hf_beam_search(tiny_gpt2_dir, prompt, 2, 5, tokenizer.eos_token_id)
    assert [c["token_ids"] for c in whole] == [w[0] for w in want]
    with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    streamed: dict[int, list[int]] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            streamed.setdefault(c["index"], []).extend(c.get("token_ids") or [])
    assert [streamed[i] for i in range(2)] == [w[0] for w in want]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"n": 11}, "n"),
        ({"stop": ["x"]}, "stop"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"response_format": {"type": "json_object"}}, "use_beam_search"),
        ({"early_stopping": True}, "early_stopping"),
        ({"length_penalty": 1e308}, "length_penalty"),
    ],
)
def test_what_beam_search_cannot_honor_is_a_400(client, extra, param):
    body = CHAT | {"use_beam_search": True} | extra
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


class FakeEngine:
    """Every beam's next-token logprobs from one table, whatever its tokens: EOS (9)
    first, then 1, 2, 3."""

    TABLE = [(9, -0.3), (1, -0.4), (2, -1.0), (3, -2.0)]

    def __init__(self) -> None:
        self.info = SimpleNamespace(eos_token_ids=frozenset({9}))
        self.prompts: list[list[list[int]]] = []

    def submit(self, request_id, prompts, params, images=None):
        self.prompts.append(prompts)
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        top = self.TABLE[: params.logprobs]
        outs = [
            RequestOutput(
                rid,
                0,
                [9],
                "",
                [TokenLogprob(9, -0.3, 1, top)],
                True,
                "length",
                None,
                len(p),
                1,
                0,
                None,
            )  # fmt: skip
            for rid, p in zip(ids, prompts, strict=True)
        ]
        return SimpleNamespace(request_ids=ids, outputs=outs)


@pytest.mark.parametrize("include_stop", [False, True])
@pytest.mark.parametrize("penalty", [1.0, 0.5])
def test_a_beam_that_draws_eos_is_complete(include_stop, penalty):
    engine = FakeEngine()

    async def collect(raw, stream):
        return stream.outputs

    s = SimpleNamespace(async_engine=engine, max_model_len=64, collect=collect)
    params = SamplingParams(n=2, max_tokens=2, include_stop_str_in_output=include_stop)
    outs = asyncio.run(search(s, None, "r", [7], params, penalty))
    # Scores, the length counting the prompt but not EOS: [1, 1] -0.8 / 3 ** penalty;
    # [EOS] -0.3 / 1; [1, EOS] -0.7 / 2 ** penalty; [1, 2] and [2, 1] -1.4 / 3 ** penalty.
    eos = [9] if include_stop else []
    beams = [([1, 1], "length", None), (eos, "stop", 9)]
    if penalty < 1:  # longer beams lose: -0.8 / 3 ** 0.5 < -0.3
        beams.reverse()
    assert [(o.new_token_ids, o.finish_reason, o.stop_reason) for o in outs] == beams
    assert [o.hide_last_token for o in outs] == [b[1] == "stop" and include_stop for b in beams]
    assert engine.prompts == [[[7]], [[7, 1], [7, 2]]]  # EOS ended its beam at step 1
