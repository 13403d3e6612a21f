"""What each load-test request asks for: a fixed prompt, random lengths, or a dataset.

A workload maps a request index to a `RequestSpec` deterministically from the
seed, so a rerun sends the same requests whatever the warmup count or order.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

# Common English words that are one token (with their leading space) in the
# GPT-2 and Llama BPE vocabularies, so N words make a prompt of roughly N tokens.
_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his it an were are which "
    "this be or has had not first one their its new after who they have her she two "
    "been other when there all during into school time may years more most only over "
    "city some world would where later up such used many can state about national out "
    "known university united then made also team three between several while these "
    "season under well film music game life group home part some both long high small "
    "large early book house water river road church station family company member "
    "people place name work year day night light power open point line side end hand "
    "king war city land field army party court council system number order form area "
    "end program series band role album song club league cup final round match player "
    "coach red blue green black white gold north south east west old young great good"
)
WORDS = tuple(dict.fromkeys(_WORD_TEXT.split()))  # unique, in order


@dataclass(frozen=True)
class RequestSpec:
    prompt: str | list[int]  # text, or token ids (completions only)
    max_tokens: int
    ignore_eos: bool


def random_prompt(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


class FixedWorkload:
    def __init__(self, prompt: str, max_tokens: int, ignore_eos: bool):
        self.spec = RequestSpec(prompt, max_tokens, ignore_eos)

    def request(self, index: int) -> RequestSpec:
        return self.spec


class RandomWorkload:
    """Prompt and output lengths uniform in [lo, hi]; ignore_eos makes outputs hit max_tokens."""

    def __init__(
        self,
        input_len_range: tuple[int, int],
        output_len_range: tuple[int, int],
        seed: int,
        token_ids: bool = False,
    ):
        for lo, hi in (input_len_range, output_len_range):
            if not 1 <= lo <= hi:
                raise ValueError(f"bad length range [{lo}, {hi}]: want 1 <= A <= B")
        self.input_len_range = input_len_range
        self.output_len_range = output_len_range
        self.seed = seed
        # Token ids give exact prompt lengths whatever the server's tokenizer is.
        self.token_ids = token_ids

    def request(self, index: int) -> RequestSpec:
        # A string seed is hashed deterministically (unlike hash() of a tuple).
        rng = random.Random(f"{self.seed}:{index}")
        num_words = rng.randint(*self.input_len_range)
        max_tokens = rng.randint(*self.output_len_range)
        if self.token_ids:
            prompt: str | list[int] = [rng.randrange(100, 10000) for _ in range(num_words)]
        else:
            prompt = random_prompt(rng, num_words)
        return RequestSpec(prompt, max_tokens, ignore_eos=True)


class DatasetWorkload:
    """JSONL lines of {"prompt": str, "max_tokens": int (optional)}, taken in order, cycling."""

    def __init__(self, path: Path, default_max_tokens: int, ignore_eos: bool):
        self.specs: list[RequestSpec] = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                    prompt = item["prompt"]
                    max_tokens = int(item.get("max_tokens") or default_max_tokens)
                except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                    raise ValueError(f"{path}:{lineno}: bad dataset line ({e!r})") from None
                if not isinstance(prompt, str):
                    raise ValueError(f"{path}:{lineno}: 'prompt' must be a string")
                self.specs.append(RequestSpec(prompt, max_tokens, ignore_eos))
        if not self.specs:
            raise ValueError(f"{path}: no prompts")

    def request(self, index: int) -> RequestSpec:
        return self.specs[index % len(self.specs)]


Workload = FixedWorkload | RandomWorkload | DatasetWorkload
