"""SamplingParams: OpenAI's sampling fields plus vLLM's extensions, validated."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.bad_words import bad_words_token_ids
from engine.structured.spec import GrammarSpec

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: up to max_model_len
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM: only these ids may be generated
    # vLLM's bad_words: words never generated (engine/bad_words.py), and their spellings
    # as token ids, which with_bad_words fills in from the tokenizer before sampling.
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] | None = None
    logprobs: int | None = None  # number of top logprobs besides the sampled token's
    # vLLM's prompt_logprobs: each prompt token's logprob (but the first's), with the
    # number of top alternatives given here; computed in the prefill.
    prompt_logprobs: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Report only when finished, as one delta holding everything (vLLM's
    # RequestOutputKind.FINAL_ONLY): no per-step outputs, text decoded once.
    final_only: bool = False
    # False: outputs carry token ids and no text (vLLM's SamplingParams.detokenize).
    # The server's API processes decode such streams themselves, off the engine.
    detokenize: bool = True
    # Structured outputs: the output must match this grammar (engine/structured/).
    grammar: GrammarSpec | None = None
    # The LoRA adapter to generate with (EngineConfig.lora_modules' name); None: the base
    # model. The server sets it from the request's `model`.
    lora_name: str | None = None
    # vLLM's cache_salt: the prefix cache shares blocks only among requests of one salt
    # (so that one tenant cannot time another's cached prompts).
    cache_salt: str | None = None
    # vLLM's request priority (lower first) under EngineConfig.scheduling_policy
    # "priority"; the engine refuses any other value than 0 without it.
    priority: int = 0
    # Return the prompt's embedding (engine/pooling.py: its last token's final hidden
    # state, L2-normalized) with the one token generated, which the server drops.
    pooling: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias:
            # JSON object keys arrive as strings ("50256").
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError) as e:
                raise ValueError(f"logit_bias must map token ids to numbers: {e}") from None
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if self.n < 1 or self.n > 128:
            raise ValueError(f"n must be in [1, 128], got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if self.grammar is not None and self.min_tokens:
            # The grammar may allow nothing but EOS, which min_tokens forbids.
            raise ValueError("min_tokens cannot be combined with structured outputs")
        if self.pooling and (self.n != 1 or self.max_tokens != 1):
            raise ValueError("an embedding (pooling) request generates one token of one choice")
        if any(not s for s in self.stop):
            raise ValueError("stop must not contain empty strings")
        if self.stop and not self.detokenize:
            raise ValueError("stop needs detokenize: a stop string is matched in the text")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative token ids")
        for token_id, bias in (self.logit_bias or {}).items():
            if token_id < 0:
                raise ValueError(f"logit_bias has a negative token id {token_id}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
            if min(self.allowed_token_ids) < 0:
                raise ValueError("allowed_token_ids must be non-negative token ids")
        if self.cache_salt is not None and not self.cache_salt:
            raise ValueError("cache_salt must be a non-empty string if given")
        if any(not w.strip() for w in self.bad_words):
            raise ValueError("bad_words must not contain empty or blank strings")
        self._derive()

    def _derive(self) -> None:
        # The hot decode path asks these of every request every step: answer once.
        self.greedy = self.temperature == 0.0 or self.top_k == 1
        self.has_penalties = (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
        # Greedy with nothing to apply but a grammar's mask (and min_tokens' while it
        # lasts): the masked logits' argmax.
        self.greedy_plain = (
            self.greedy
            and not self.has_penalties
            and not self.logit_bias
            and self.allowed_token_ids is None
            and not self.bad_words
            and self.logprobs is None
        )
        self.argmax_masked = self.greedy_plain and self.min_tokens == 0
        self.argmax_only = self.argmax_masked and self.grammar is None
        # Penalties and bad words of several tokens read every generated id, and logprobs
        # are read back with the ids: such a request's step is sampled with the previous
        # step's tokens on the host.
        self.bans_after_tokens = any(len(ids) > 1 for ids in self.bad_words_token_ids or ())
        self.needs_sync = self.has_penalties or self.bans_after_tokens or self.logprobs is not None
        # Speculative decoding may draft its next tokens (engine/speculative.py):
        # Sampler.verify processes every draft's row as a step at that position would
        # (penalties, min_tokens and bad words counting the drafts before it), and a token's
        # logprobs are its own row's. A seed promises the tokens of a run without
        # drafts; a grammar's mask follows its matcher one token at a time.
        self.speculates = self.seed is None and self.grammar is None and not self.pooling
        # Streamed as bare ids: its outputs between the first and the last can travel
        # as TokenDeltas entries.
        self.plain = not self.final_only and not self.detokenize and self.logprobs is None

    def with_bad_words(self, encode: Callable[[str], list[int]]) -> None:
        """Fill in bad_words_token_ids from the tokenizer's encode (no special tokens)."""
        if self.bad_words and self.bad_words_token_ids is None:
            self.bad_words_token_ids = bad_words_token_ids(self.bad_words, encode)
            self._derive()

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the params name must exist in the model's vocabulary."""
        bad_ids = [t for ids in self.bad_words_token_ids or () for t in ids]
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", self.logit_bias or ()),  # its keys
            ("allowed_token_ids", self.allowed_token_ids or ()),
            ("bad_words", bad_ids),
        ):
            for token_id in ids:
                if token_id >= vocab_size:
                    raise ValueError(
                        f"{name} has token id {token_id} outside the vocabulary (size {vocab_size})"
                    )
