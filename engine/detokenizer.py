"""Incremental detokenization with stop strings, as vLLM's detokenize_incrementally.

Decoding token by token is wrong for byte-level BPE: a character may span
tokens (emoji, CJK), and some tokenizers decode a token differently at the
start of a text (leading-space handling). So each step decodes a short window
of already-emitted tokens plus the new ones and keeps what the window adds:

    tokens:  ... [prefix_offset ......... read_offset) [new tokens ...]
                  └ prefix_text: decoded before ┘
    new text = decode(tokens[prefix_offset:])[len(prefix_text):]

While the new text ends in U+FFFD the last character is still incomplete:
the offsets stay put and the next step decodes the same window, longer.
"""

from __future__ import annotations

from engine.sampling_params import SamplingParams

# Tokens of context decoded before the new ones (vLLM's value).
PREFIX_WINDOW = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.skip_special_tokens = params.skip_special_tokens
        self.max_stop_len = max((len(s) for s in params.stop), default=0)

        # The prompt's last tokens are context only; they never reach output_text.
        self.tokens = self._to_tokens(prompt_token_ids[-(PREFIX_WINDOW + 2) :])
        self.read_offset = len(self.tokens)
        self.prefix_offset = max(self.read_offset - PREFIX_WINDOW, 0)
        if self._decode(self.prefix_offset, self.read_offset).endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: the output's first bytes
            # would complete it. Decode the output on its own instead.
            self.tokens, self.prefix_offset, self.read_offset = [], 0, 0

        self._text = ""  # decoded text of the output's tokens before read_offset
        self._tail = ""  # decoded text after read_offset; ends in U+FFFD (incomplete)
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
        return self._text + self._tail

    def update(self, new_token_ids: list[int]) -> str | None:
        """Decode the new tokens; return the stop string they complete, if any."""
        if self._stopped_text is not None:
            return None
        self.tokens += self._to_tokens(new_token_ids)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        window_text = self._decode(self.prefix_offset, len(self.tokens))
        new_text = window_text[len(prefix_text) :]
        if not new_text or new_text.endswith(REPLACEMENT_CHAR):
            # Nothing new (a skipped special token) or an incomplete character:
            # keep the window where it is and decode it again, longer, next time.
            self._tail = new_text
        else:
            self._text += new_text
            self._tail = ""
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return self._check_stop()

    def get_delta(self, finished: bool) -> str:
        """Text not handed out before that is safe to emit now.

        Unless finished (or stopped), hold back an incomplete trailing character
        and any suffix that could be the start of a stop string.
        """
        text = self.output_text
        end = len(text)
        if not finished and self._stopped_text is None:
            end = len(self._complete_text())
            end -= self._stop_prefix_len(text[:end])
        end = max(end, self._emitted_len)
        delta = text[self._emitted_len : end]
        self._emitted_len = end
        return delta

    # ---- helpers ----

    def _complete_text(self) -> str:
        """Output text without the trailing U+FFFD of an incomplete character."""
        return self._text + self._tail.rstrip(REPLACEMENT_CHAR)

    def _check_stop(self) -> str | None:
        if not self.params.stop:
            return None
        text = self._complete_text()
        # A new match must end in the text not searched yet.
        start = max(self._checked_len - self.max_stop_len + 1, 0)
        self._checked_len = len(text)
        matches = [(text.find(s, start), s) for s in self.params.stop]
        matches = [(index, s) for index, s in matches if index != -1]
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

    def _to_tokens(self, token_ids: list[int]) -> list[str]:
        tokens = self.tokenizer.convert_ids_to_tokens(
            list(token_ids), skip_special_tokens=self.skip_special_tokens
        )
        return [t if t is not None else "" for t in tokens]  # None: id outside the vocab

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self.tokenizer.convert_tokens_to_string(self.tokens[start:end])
