"""IncrementalDetokenizer: streamed deltas, split multi-byte characters, stop strings."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.detokenizer import _BYTE_TABLES, IncrementalDetokenizer, byte_table
from engine.sampling_params import SamplingParams

EOS = "<|endoftext|>"

ENGLISH = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "She sells sea shells by the sea shore, then goes home.",
    "Streaming tokens one at a time makes the answer feel fast.",
    "A scheduler decides which requests run in every step.",
    "Hello, world! How are you doing today?",
    "Numbers like 12345 and 3.14159 appear in text too.",
]
EMOJI = ["🙂", "🚀", "🎉", "👍🏽", "❤️", "🧪", "🐍", "👨‍👩‍👧"]
CJK = ["你好，世界", "推理服务器", "東京タワー", "안녕하세요", "今日はいい天気です", "模型生成文本"]


def corpus() -> list[str]:
    rng = random.Random(0)
    lines = []
    for i in range(300):
        words = [rng.choice(ENGLISH)]
        words += rng.sample(EMOJI, 2) if i % 3 else rng.sample(CJK, 2)
        rng.shuffle(words)
        lines.append(" ".join(words))
    return lines


@pytest.fixture(scope="module", params=["byte-table", "decode-stream"])
def tokenizer(request) -> PreTrainedTokenizerFast:
    """A ~400-entry byte-level BPE: too small to hold whole emoji or CJK characters.

    Every test runs on both roads: the byte table, and DecodeStream (which
    tokenizers that do not decode byte-level take)."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOS],
        show_progress=False,
    )
    bpe.train_from_iterator(corpus(), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS)
    assert byte_table(tokenizer) is not None
    if request.param == "decode-stream":
        _BYTE_TABLES[tokenizer] = None
    return tokenizer


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(tokenizer, ids, params=None, prompt=(), chunk=1):
    """Feed ids `chunk` at a time; return (deltas incl. the final flush, stop string)."""
    detok = IncrementalDetokenizer(tokenizer, list(prompt), params or SamplingParams())
    deltas, stop = [], None
    for start in range(0, len(ids), chunk):
        stop = detok.update(ids[start : start + chunk])
        deltas.append(detok.get_delta(finished=stop is not None))
        if stop is not None:
            break
    else:
        deltas.append(detok.get_delta(finished=True))
    assert "".join(deltas) == detok.output_text
    return deltas, stop


TEXTS = [
    "Hello 🙂 world",
    "🚀🎉👍🏽",
    "你好，世界！推理服务器很快。",
    "Mixed: 東京タワー and 🐍 code, 안녕하세요 👨‍👩‍👧 done.",
    "plain ascii only",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
@pytest.mark.parametrize("prompt", ["", "Prompt 你好 🙂 "])
def test_deltas_concatenate_to_the_full_decode(tokenizer, text, chunk, prompt):
    ids = encode(tokenizer, text)
    deltas, stop = stream(tokenizer, ids, prompt=encode(tokenizer, prompt), chunk=chunk)
    assert stop is None
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_multibyte_characters_really_split_across_tokens(tokenizer):
    ids = encode(tokenizer, "🚀🎉👍🏽 推理服务器")
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


def test_output_text_tracks_the_full_decode_at_every_step(tokenizer):
    ids = encode(tokenizer, TEXTS[3])
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    for n in range(len(ids)):
        detok.update(ids[n : n + 1])
        # Includes a trailing U+FFFD while a character is incomplete, as decode does.
        assert detok.output_text == tokenizer.decode(ids[: n + 1])


@pytest.mark.parametrize("seed", range(5))
def test_random_token_streams_keep_the_invariant(tokenizer, seed):
    """Arbitrary ids (invalid UTF-8 included): deltas still add up to decode()."""
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(60)]
    for skip in (True, False):
        params = SamplingParams(skip_special_tokens=skip)
        deltas, _ = stream(tokenizer, ids, params, prompt=encode(tokenizer, "hi 🙂"))
        full = tokenizer.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) == full
        if "\ufffd" not in full:
            assert not any("\ufffd" in d for d in deltas)


def test_incomplete_character_at_the_end_is_flushed_as_decode_has_it(tokenizer):
    ids = encode(tokenizer, "ok 🚀")
    cut = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    deltas, _ = stream(tokenizer, ids[:cut])
    assert "\ufffd" not in "".join(deltas[:-1])
    assert "".join(deltas) == tokenizer.decode(ids[:cut])


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(tokenizer, skip):
    ids = encode(tokenizer, "Hello 🙂") + [tokenizer.eos_token_id] + encode(tokenizer, " more")
    deltas, _ = stream(tokenizer, ids, SamplingParams(skip_special_tokens=skip))
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert (EOS in "".join(deltas)) is not skip


# ---- stop strings ----


def test_stop_string_spanning_tokens_cuts_exactly(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    stop_str = "fox jumps"
    ids = encode(tokenizer, text)
    # The stop string must really cover several tokens.
    spans = [tokenizer.decode(ids[: n + 1]) for n in range(len(ids))]
    first = next(n for n, s in enumerate(spans) if len(s) > text.index(stop_str))
    last = next(n for n, s in enumerate(spans) if stop_str in s)
    assert last - first >= 1

    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=[stop_str]))
    deltas = []
    for n in range(len(ids)):
        stop = detok.update(ids[n : n + 1])
        deltas.append(detok.get_delta(finished=stop is not None))
        if stop is not None:
            break
    assert stop == stop_str and n == last  # matched on the token that completes it
    assert detok.output_text == "The quick brown "
    assert "".join(deltas) == "The quick brown "


def test_include_stop_str_in_output(tokenizer):
    ids = encode(tokenizer, "Hello, world! How are you doing today?")
    params = SamplingParams(stop=["world!"], include_stop_str_in_output=True)
    deltas, stop = stream(tokenizer, ids, params)
    assert stop == "world!"
    assert "".join(deltas) == "Hello, world!"


def test_earliest_stop_string_wins(tokenizer):
    ids = encode(tokenizer, "She sells sea shells by the sea shore")
    params = SamplingParams(stop=["shore", "sea", "sells sea shells"])
    _, stop = stream(tokenizer, ids, params, chunk=len(ids))
    assert stop == "sells sea shells"


def test_stop_string_with_split_characters(tokenizer):
    ids = encode(tokenizer, "Launch 🚀🎉 party 你好世界 end")
    for stop_str, expected in (("🎉 p", "Launch 🚀"), ("好世", "Launch 🚀🎉 party 你")):
        for chunk in (1, 2):
            deltas, stop = stream(tokenizer, ids, SamplingParams(stop=[stop_str]), chunk=chunk)
            assert stop == stop_str
            assert "".join(deltas) == expected
            assert not any("\ufffd" in d for d in deltas)


def test_possible_stop_prefix_is_held_back_then_released(tokenizer):
    text = "The cat sat on the mat and then sat down."
    stop_str = "sat down"
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=[stop_str]))
    emitted = ""
    held_once = False
    for token_id in ids:
        stop = detok.update([token_id])
        emitted += detok.get_delta(finished=stop is not None)
        if stop is not None:
            break
        full = detok.output_text
        assert full.startswith(emitted)
        pending = full[len(emitted) :]
        # Whatever is held back is exactly a beginning of the stop string.
        assert stop_str.startswith(pending)
        if pending.startswith("sat") and "sat o" not in full:
            held_once = True
        if full.endswith("sat on"):
            assert emitted == full  # "sat " turned out not to be "sat down"
    assert held_once
    assert stop == stop_str
    assert emitted == "The cat sat on the mat and then "


def test_held_back_text_is_flushed_when_finished(tokenizer):
    ids = encode(tokenizer, "all is well, sa")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["sat down"]))
    detok.update(ids)
    assert detok.get_delta(finished=False) == "all is well, "
    assert detok.get_delta(finished=True) == "sa"
    assert detok.get_delta(finished=True) == ""


def test_nothing_after_a_stop(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["dog"]))
    assert detok.update(encode(tokenizer, "a lazy dog barks")) == "dog"
    assert detok.update(encode(tokenizer, " again")) is None
    assert detok.output_text == "a lazy "
    assert detok.get_delta(finished=False) == "a lazy "


def test_window_keeps_leading_spaces_of_metaspace_tokenizers():
    """SentencePiece-style decoders drop the "▁" at the start of a text, so decoding
    each token alone would lose every space; the context window keeps them."""
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    bpe.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"], show_progress=False)
    bpe.train_from_iterator(ENGLISH * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>")
    text = "the lazy dog jumps over the quick fox"
    ids = encode(tokenizer, text)
    assert tokenizer.decode(ids[1:2]) == tokenizer.decode(ids[1:2]).lstrip()
    deltas, _ = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids) == text


def test_bytes_that_never_form_a_character_are_settled(tokenizer):
    # Lone UTF-8 continuation bytes can never complete a character: after a few the
    # detokenizer renders them as decode does and moves on, rather than holding them.
    cont = tokenizer.convert_tokens_to_ids(["\u0122"])  # ByteLevel's symbol for byte 0x80
    assert tokenizer.decode(cont) == "\ufffd"
    ids = cont * 9 + tokenizer.encode("ok then", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    deltas = []
    for i in ids:
        detok.update([i])
        deltas.append(detok.get_delta(finished=False))
    deltas.append(detok.get_delta(finished=True))
    assert "".join(deltas) == tokenizer.decode(ids)
    assert len(detok._pending) == 0 and "".join(deltas[:9])  # released before the text came


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("prompt", ["", "Prompt 你好 🙂 ", "ends mid 🚀"])
def test_decode_all_equals_the_streamed_text(tokenizer, seed, prompt):
    rng = random.Random(seed)
    if seed < 2:
        ids = encode(tokenizer, TEXTS[3 + seed])
    else:  # arbitrary ids: invalid UTF-8 and special tokens included
        ids = [rng.randrange(len(tokenizer)) for _ in range(80)]
    prompt_ids = encode(tokenizer, prompt)
    if prompt == "ends mid 🚀":
        prompt_ids = prompt_ids[:-1]  # the prompt ends inside a character
    for skip in (True, False):
        params = SamplingParams(skip_special_tokens=skip)
        deltas, _ = stream(tokenizer, ids, params, prompt=prompt_ids)
        detok = IncrementalDetokenizer(tokenizer, prompt_ids, params)
        detok.decode_all(ids)
        assert detok.get_delta(finished=True) == "".join(deltas)


def test_decode_all_keeps_leading_spaces_of_metaspace_tokenizers():
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    bpe.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"], show_progress=False)
    bpe.train_from_iterator(ENGLISH * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>")
    assert byte_table(tokenizer) is None  # not byte-level: DecodeStream
    ids = encode(tokenizer, "the lazy dog jumps over the quick fox")
    detok = IncrementalDetokenizer(tokenizer, ids[:3], SamplingParams())
    detok.decode_all(ids[3:])
    assert detok.get_delta(finished=True) == "".join(stream(tokenizer, ids[3:], prompt=ids[:3])[0])
    # Spaces at the seam survive: prompt text + output text is the whole text.
    assert tokenizer.decode(ids[:3]) + detok.output_text == tokenizer.decode(ids)
