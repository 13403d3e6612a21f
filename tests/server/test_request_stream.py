"""RequestStream: deltas queued while the event loop was busy are merged per choice;
stop strings are matched on the server, at the token that completes them."""

from __future__ import annotations

import json

import pytest

from engine.request import RequestMetrics, RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from server.request_stream import RequestStream, coalesce
from tests.server.live_server import MAX_MODEL_LEN


def out(
    rid: str, index: int, ids: list[int], text: str, finished=False, logprobs=None
) -> RequestOutput:
    return RequestOutput(
        request_id=rid,
        index=index,
        new_token_ids=ids,
        new_text=text,
        new_logprobs=logprobs,
        finished=finished,
        finish_reason="length" if finished else None,
        stop_reason=None,
        num_prompt_tokens=3,
        num_output_tokens=len(ids),
        num_cached_tokens=0,
        metrics=RequestMetrics(0.0),
    )


def test_coalesce_merges_per_choice_and_keeps_the_last_state():
    lp = [TokenLogprob(1, -0.5, 1, [])]
    merged = coalesce(
        [
            out("a", 0, [1], "He", logprobs=lp),
            out("a", 1, [7], "X"),
            out("a", 0, [2], "llo", logprobs=lp),
            out("a", 0, [3], "!", finished=True, logprobs=lp),
        ]
    )
    assert [(m.request_id, m.index) for m in merged] == [("a", 0), ("a", 1)]
    first = merged[0]
    assert first.new_token_ids == [1, 2, 3] and first.new_text == "Hello!"
    assert first.finished and first.finish_reason == "length"
    assert len(first.new_logprobs) == 3
    assert merged[1].new_text == "X" and merged[1].new_logprobs is None


def test_coalesce_leaves_single_outputs_alone():
    single = [out("a", 0, [1], "x"), out("b", 0, [2], "y")]
    assert coalesce(single) == single


class ByteDecoder:
    """An IncrementalDetokenizer stand-in: token t is the character chr(t)."""

    def __init__(self, stop: list[str]) -> None:
        self.text, self.emitted, self.stop, self.stopped = "", 0, stop, False

    def update(self, ids: list[int]) -> str | None:
        self.text += "".join(map(chr, ids))
        for s in self.stop:
            if s in self.text and not self.stopped:
                self.stopped = True
                self.text = self.text[: self.text.index(s)]
                return s
        return None

    def get_delta(self, finished: bool) -> str:
        delta, self.emitted = self.text[self.emitted :], len(self.text)
        return delta


def test_a_stop_string_cuts_the_delta_at_its_token_and_aborts_when_all_choices_end():
    aborted: list = []
    decoders = {("a", i): ByteDecoder(["cd"]) for i in range(2)}
    stream = RequestStream(["a"], 2, decoders, True, aborted.append)
    lp = [TokenLogprob(t, -1.0, 1, []) for t in b"abcdef"]
    first = out("a", 0, list(b"ab"), "", logprobs=lp[:2])
    (got,) = stream.decode([first])
    assert got.new_text == "ab" and not got.finished
    # "d" completes the stop string: "e" and "f" are dropped, with their logprobs.
    (got,) = stream.decode([out("a", 0, list(b"cdef"), "", logprobs=lp[2:])])
    assert got.new_token_ids == list(b"cd") and len(got.new_logprobs) == 2
    assert got.new_text == "" and got.finished
    assert (got.finish_reason, got.stop_reason) == ("stop", "cd")
    assert got.num_output_tokens == 2  # the engine had counted 4 in this delta
    assert got.metrics is not None  # the end is now, for the latency metrics
    assert stream.decode([out("a", 0, list(b"g"), "")]) == []  # the engine's late tokens
    assert stream.to_abort == []  # choice 1 still runs
    (got,) = stream.decode([out("a", 1, list(b"xcd"), "")])
    assert got.new_text == "x" and got.stop_reason == "cd"
    assert stream.to_abort == ["a"] and aborted == []  # a stop is no client abort


def test_choices_the_engine_ends_need_no_abort():
    stream = RequestStream(["a"], 1, {("a", 0): ByteDecoder(["zz"])}, True, list.append)
    (got,) = stream.decode([out("a", 0, list(b"xy"), "", finished=True)])
    assert got.new_text == "xy" and got.finish_reason == "length"
    assert stream.to_abort == []


@pytest.fixture(scope="module")
def llm(tiny_gpt2_dir):
    from engine.llm import LLM

    return LLM(tiny_gpt2_dir, device="cpu", max_model_len=MAX_MODEL_LEN)


@pytest.mark.parametrize("stream", [False, True])
def test_served_stop_strings_match_the_engines_own(client, llm, stream):
    """The server matches stop strings in its own decode of an ids-only stream; the
    offline LLM's engine in its detokenizer. Same text, reason, and token count."""
    base = {"prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True}
    for sampling in ({"temperature": 0.0}, {"temperature": 0.9, "seed": 7, "n": 2}):
        plain = client.post("/v1/completions", json=base | sampling).json()
        text = plain["choices"][0]["text"]
        stops = [text[len(text) // 2 : len(text) // 2 + 2], text[-3:]]
        for include in (False, True):
            body = base | sampling | {"stop": stops, "include_stop_str_in_output": include}
            params = SamplingParams(
                max_tokens=40, ignore_eos=True, stop=stops, include_stop_str_in_output=include,
                **{k: v for k, v in sampling.items()},
            )  # fmt: skip
            (expected,) = llm.generate(base["prompt"], params, use_tqdm=False)
            got = served_choices(client, body, stream)
            assert got[0]["finish_reason"] == "stop"  # the stops come from choice 0's text
            for choice in expected.outputs:
                assert got[choice.index]["text"] == choice.text
                assert got[choice.index]["finish_reason"] == choice.finish_reason
                assert got[choice.index]["stop_reason"] == choice.stop_reason
            assert got["usage"] == sum(len(c.token_ids) for c in expected.outputs)


def served_choices(client, body: dict, stream: bool) -> dict:
    """index -> {text, finish_reason, stop_reason}, and "usage": completion tokens."""
    if not stream:
        r = client.post("/v1/completions", json=body).json()
        got: dict = {c["index"]: c for c in r["choices"]}
        got["usage"] = r["usage"]["completion_tokens"]
        return got
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    got = {}
    with client.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("usage"):
                got["usage"] = chunk["usage"]["completion_tokens"]
            for c in chunk["choices"]:
                entry = got.setdefault(c["index"], {"text": ""})
                entry["text"] += c["text"]
                entry.update(finish_reason=c["finish_reason"], stop_reason=c["stop_reason"])
    return got


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_tokens_text_is_left_out_unless_asked_for(client, llm, tokenizer, stream):
    """As vLLM: the id that stops a choice (EOS or stop_token_ids) counts as a token,
    but its text is not the answer's, special or not, unless include_stop_str_in_output."""
    base = {"prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    (plain,) = llm.generate(base["prompt"], SamplingParams(**base_params(base)), use_tqdm=False)
    ids = plain.outputs[0].token_ids
    stop_id = ids[4]
    cut = ids.index(stop_id)
    for include in (False, True):
        extra = {"stop_token_ids": [stop_id], "include_stop_str_in_output": include}
        want = tokenizer.decode(ids[: cut + include])
        got = served_choices(client, base | extra, stream)
        assert (got[0]["text"], got[0]["stop_reason"]) == (want, stop_id)
        assert got["usage"] == cut + 1
        params = SamplingParams(**base_params(base), **extra)
        (offline,) = llm.generate(base["prompt"], params, use_tqdm=False)
        assert offline.outputs[0].text == want


def base_params(body: dict) -> dict:
    return {"max_tokens": body["max_tokens"], "ignore_eos": True, "temperature": 0.0}
