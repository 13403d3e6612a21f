"""SamplingParams: normalisation and validation (errors name the parameter)."""

from __future__ import annotations

import pytest

from engine.bad_words import bad_words_token_ids, banned_ids
from engine.sampling_params import MAX_LOGPROBS, SamplingParams


def test_defaults_are_valid_and_random():
    params = SamplingParams()
    assert not params.greedy and not params.has_penalties
    assert params.stop == [] and params.stop_token_ids == []


def test_normalisation():
    params = SamplingParams(stop="###", top_k=-1, logit_bias={"50": 1, 7: -2.5})
    assert params.stop == ["###"]
    assert params.top_k == 0
    assert params.logit_bias == {50: 1.0, 7: -2.5}


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        (dict(temperature=0.0), True),
        (dict(temperature=1.0, top_k=1), True),
        (dict(temperature=0.5), False),
        (dict(temperature=1.0, top_k=2), False),
    ],
)
def test_greedy(kwargs, greedy):
    assert SamplingParams(**kwargs).greedy is greedy


@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty", "repetition_penalty"])
def test_has_penalties(name):
    assert SamplingParams(**{name: 1.5}).has_penalties


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=2.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.1), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(seed=2**64), "seed"),
        (dict(n=0), "n"),
        (dict(n=129), "n"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3.0), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=2.5), "repetition_penalty"),
        (dict(logprobs=-1), "logprobs"),
        (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=10, max_tokens=5), "min_tokens"),
        (dict(stop=["ok", ""]), "stop"),
        (dict(stop_token_ids=[3, -1]), "stop_token_ids"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={5: 101.0}), "logit_bias"),
        (dict(logit_bias={"five": 1.0}), "logit_bias"),
        (dict(logit_bias={5: "lots"}), "logit_bias"),
    ],
    ids=lambda v: str(v),
)
def test_bad_values_raise_naming_the_parameter(kwargs, param):
    with pytest.raises(ValueError, match=rf"^{param}\b"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_tokens=None, min_tokens=1000),
        dict(temperature=0.0),
        dict(temperature=2.0, top_p=1.0, top_k=50, min_p=1.0),
        dict(logprobs=0),
        dict(logprobs=MAX_LOGPROBS),
        dict(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=2.0),
        dict(min_tokens=16, max_tokens=16),
        dict(logit_bias={0: -100, 1: 100}),
    ],
    ids=str,
)
def test_edge_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_check_vocab():
    SamplingParams(stop_token_ids=[99], logit_bias={98: 1.0}).check_vocab(100)
    with pytest.raises(ValueError, match="^stop_token_ids"):
        SamplingParams(stop_token_ids=[100]).check_vocab(100)
    with pytest.raises(ValueError, match="^logit_bias"):
        SamplingParams(logit_bias={100: 1.0}).check_vocab(100)


def test_bad_words_spellings_and_bans():
    # "ab" spells [1, 2] bare and [9, 2] after a space: both count, as in vLLM.
    spell = {"ab": [1, 2], " ab": [9, 2], "c": [3], " c": [3]}
    assert bad_words_token_ids(["ab", "  c"], spell.__getitem__) == [[1, 2], [9, 2], [3]]
    spellings = [[1, 2], [9, 2], [3]]
    assert banned_ids(spellings, []) == [3]  # a word's later tokens need its first before
    assert banned_ids(spellings, [4, 1]) == [2, 3]
    assert banned_ids(spellings, [9]) == [2, 3]
    assert banned_ids(spellings, [1, 4]) == [3]


def test_bad_words_and_allowed_token_ids_turn_off_the_argmax_path_and_are_checked():
    params = SamplingParams(temperature=0.0, bad_words=["no"])
    assert not params.greedy_plain and not params.needs_sync  # no spellings known yet
    params.with_bad_words({"no": [4, 5], " no": [6, 5]}.__getitem__)
    assert params.bad_words_token_ids == [[4, 5], [6, 5]]
    assert params.needs_sync  # a two-token word reads the generated ids
    assert not SamplingParams(temperature=0.0, allowed_token_ids=[3]).greedy_plain
    with pytest.raises(ValueError, match="bad_words has token id 5 outside"):
        params.check_vocab(5)
    with pytest.raises(ValueError, match="allowed_token_ids has token id 9 outside"):
        SamplingParams(allowed_token_ids=[1, 9]).check_vocab(5)
    with pytest.raises(ValueError, match="allowed_token_ids must not be empty"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="bad_words must not contain empty or blank"):
        SamplingParams(bad_words=["ok", "  "])
