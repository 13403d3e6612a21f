"""vLLM's bad_words: words a request never generates.

A word is banned as the tokenizer spells it at the start of a text and, where that
spelling is another token of the same length, after a space (vLLM's two spellings). A
one-token spelling is banned at every step; a longer one only at its last token, when
the tokens before it are the output's last ones (output only: the prompt is not
searched, as in vLLM).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def bad_words_token_ids(
    words: Sequence[str], encode: Callable[[str], list[int]]
) -> list[list[int]]:
    """Each word's spellings as token ids; encode: the tokenizer's, no special tokens."""
    spellings: list[list[int]] = []
    for word in words:
        bare = list(encode(word.lstrip()))
        if not bare:
            raise ValueError(f"bad_words entry {word!r} has no tokens")
        spellings.append(bare)
        spaced = list(encode(" " + word.lstrip()))
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            spellings.append(spaced)
    return spellings


def banned_ids(spellings: Sequence[Sequence[int]], generated: Sequence[int]) -> list[int]:
    """The ids the next token may not be, after the generated ones."""
    banned = []
    for ids in spellings:
        before = len(ids) - 1
        if before > len(generated):
            continue
        if before == 0 or list(generated[-before:]) == list(ids[:-1]):
            banned.append(ids[-1])
    return banned
