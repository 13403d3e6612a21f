"""Incremental detokenization with stop strings.

Decoding token by token is wrong for byte-level BPE: a character may span
tokens (emoji, CJK), and SentencePiece-style tokenizers decode a token
differently at the start of a text (leading-space handling). tokenizers'
DecodeStream solves both in Rust: it returns a token's text once it is
complete, None while a character is still partial (or for a skipped special
token). Seeding it with the prompt's last tokens makes the first output token
decode as it would inside the full text.

Byte-level BPE (GPT-2, Qwen2, Llama 3) has a faster road: every token is a
fixed byte string, so a step's tokens are a join of table entries and one
incremental UTF-8 decode, both in C. The table is built once per tokenizer and
checked against the tokenizer's own decode of every id; any disagreement keeps
DecodeStream.
"""

from __future__ import annotations

import codecs
import weakref

from tokenizers.decoders import ByteLevel, DecodeStream

from engine.sampling_params import SamplingParams

# Prompt tokens of context decoded before the first output token.
PREFIX_WINDOW = 5
# A UTF-8 character has at most 4 bytes and a byte-level token at least one: more
# pending tokens than this can never complete a character.
MAX_PENDING = 4
REPLACEMENT_CHAR = "\ufffd"


def _byte_symbols() -> dict[str, int]:
    """ByteLevel's printable stand-in for each byte (GPT-2's bytes_to_unicode), inverted."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)}
    printable |= set(range(ord("®"), ord("ÿ") + 1))
    others = [byte for byte in range(256) if byte not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


# Each id's bytes as a ByteLevel decoder renders it, by skip_special_tokens: special
# tokens as their text (False) or as nothing (True).
ByteTable = dict[bool, list[bytes]]
_BYTE_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def byte_table(tokenizer) -> ByteTable | None:
    """The tokenizer's ByteTable, or None when it does not decode byte-level (cached)."""
    if tokenizer not in _BYTE_TABLES:
        _BYTE_TABLES[tokenizer] = _build_byte_table(tokenizer.backend_tokenizer)
    return _BYTE_TABLES[tokenizer]


def _build_byte_table(backend) -> ByteTable | None:
    if not isinstance(backend.decoder, ByteLevel):
        return None
    symbols = _byte_symbols()
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    keep: list[bytes] = []
    for i in range(backend.get_vocab_size(with_added_tokens=True)):
        token = backend.id_to_token(i) or ""
        try:  # as ByteLevel's decoder: byte symbols if all are, else the text itself
            keep.append(bytes(symbols[c] for c in token))
        except KeyError:
            keep.append(token.encode())
    tables = {False: keep, True: [b"" if i in special else raw for i, raw in enumerate(keep)]}
    # Every id, both ways, against the tokenizer's own decode (one batched call each).
    single = [[i] for i in range(len(keep))]
    for skip_special, table in tables.items():
        expected = backend.decode_batch(single, skip_special_tokens=skip_special)
        if expected != [raw.decode("utf-8", "replace") for raw in table]:
            return None
    return tables


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.backend = tokenizer.backend_tokenizer  # the Rust tokenizer: fast tokenizers only
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        self.params = params
        self.skip_special_tokens = params.skip_special_tokens
        self.max_stop_len = max((len(s) for s in params.stop), default=0)

        table = byte_table(tokenizer)
        # Byte-level: ids to bytes by table, bytes to text by a C UTF-8 decoder.
        self.table = None if table is None else table[params.skip_special_tokens]
        self._partial = b""  # byte-level: the bytes of an incomplete trailing character
        context = [t for t in prompt_token_ids[-PREFIX_WINDOW:] if t < self.vocab_size]
        if self.table is not None or self.backend.decode(
            context, skip_special_tokens=False
        ).endswith(REPLACEMENT_CHAR):
            # Byte-level output text does not depend on the prompt's; and a prompt that
            # ends inside a character would have the output's first bytes complete it.
            # Either way, decode the output on its own.
            context = []
        self.context = context
        self.stream = None
        if self.table is None:
            self.stream = DecodeStream(ids=context, skip_special_tokens=self.skip_special_tokens)

        self._text = ""  # decoded text of the output's complete characters
        self._pending: list[int] = []  # ids since the last complete piece (a partial char)
        self._checked_len = 0  # chars of complete text already searched for stops
        self._stopped_text: str | None = None  # output_text once a stop string matched
        self._emitted_len = 0  # chars of output_text handed out by get_delta

    @property
    def output_text(self) -> str:
        """The generated text so far: what tokenizer.decode(output ids) gives, cut at a
        matched stop string. While a character is incomplete it ends in U+FFFD, as
        the full decode does."""
        if self._stopped_text is not None:
            return self._stopped_text
        if self.table is not None:
            return self._text + self._partial.decode("utf-8", "replace")
        if not self._pending:
            return self._text
        tail = self.backend.decode(self._pending, skip_special_tokens=self.skip_special_tokens)
        return self._text + tail

    def update(self, new_token_ids: list[int]) -> str | None:
        """Decode the new tokens; return the stop string they complete, if any."""
        if self._stopped_text is not None:
            return None
        if self.table is not None:
            data = self._partial + self._bytes(new_token_ids)
            text, used = codecs.utf_8_decode(data, "replace", False)
            self._partial = data[used:]
            self._text += text
            return self._check_stop() if self.params.stop else None
        for token_id in new_token_ids:
            if token_id >= self.vocab_size:
                continue  # a padding row of the model's vocabulary: no text
            piece = self.stream.step(self.backend, token_id)
            if piece is None:
                self._pending.append(token_id)
                if len(self._pending) > MAX_PENDING:
                    self._settle_pending()
            else:
                self._text += piece
                self._pending.clear()
        return self._check_stop()

    def decode_all(self, token_ids: list[int]) -> None:
        """Decode a whole output in one call: for a request that reports only when done
        and has no stop strings to watch. The same text as update() token by token
        (decode of the output, read after the prompt's context)."""
        assert not self._text and not self._pending, "decode_all replaces update, not follows it"
        if self.table is not None:
            self._text = self._bytes(token_ids).decode("utf-8", "replace")
            return
        ids = [t for t in token_ids if t < self.vocab_size]
        skip = self.skip_special_tokens
        prefix = self.backend.decode(self.context, skip_special_tokens=skip)
        text = self.backend.decode(self.context + ids, skip_special_tokens=skip)
        if text.startswith(prefix):
            self._text = text[len(prefix) :]
        else:  # a decoder that rewrites across the seam: the output alone, as update() starts
            self._text = self.backend.decode(ids, skip_special_tokens=skip)

    def get_delta(self, finished: bool) -> str:
        """Text not handed out before that is safe to emit now.

        Unless finished (or stopped), hold back an incomplete trailing character
        and any suffix that could be the start of a stop string."""
        if finished or self._stopped_text is not None:
            text = self.output_text
            end = len(text)
        else:  # only complete characters: no need to decode the pending ones
            text = self._text
            end = len(text) - self._stop_prefix_len(text) if self.params.stop else len(text)
        end = max(end, self._emitted_len)
        delta = text[self._emitted_len : end]
        self._emitted_len = end
        return delta

    def _bytes(self, token_ids: list[int]) -> bytes:
        table = self.table
        try:
            return b"".join([table[t] for t in token_ids])
        except IndexError:  # a padding row of the model's vocabulary: no text
            return b"".join([table[t] for t in token_ids if t < len(table)])

    def _settle_pending(self) -> None:
        """Pending bytes that can no longer form a character are text as decode renders
        them (U+FFFD); the stream restarts after them, so it never re-decodes a window
        that only grows."""
        self._text += self.backend.decode(
            self._pending, skip_special_tokens=self.skip_special_tokens
        )
        self._pending.clear()
        self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)

    def _check_stop(self) -> str | None:
        if not self.params.stop:
            return None
        text = self._text
        # A new match must end in the text not searched yet.
        start = max(self._checked_len - self.max_stop_len + 1, 0)
        self._checked_len = len(text)
        matches = [(i, s) for s in self.params.stop if (i := text.find(s, start)) != -1]
        if not matches:
            return None
        index, stop = min(matches, key=lambda m: m[0])  # the earliest in the text wins
        if self.params.include_stop_str_in_output:
            index += len(stop)
        self._stopped_text = text[:index]
        return stop

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.params.stop:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
