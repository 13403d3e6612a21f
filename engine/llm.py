"""Offline API: LLM(model=...).generate(prompts, params) -> completed outputs."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from engine.classification import class_probabilities
from engine.config import EngineConfig
from engine.engine import Engine
from engine.heap import freeze_startup_heap
from engine.request import TokenLogprob
from engine.sampling_params import SamplingParams
from engine.structured.spec import build_grammar


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    embedding: list[float] | None = None  # SamplingParams.pooling: the prompt's embedding


@dataclass
class GenerationOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: per prompt token, its logprob (the first: None).
    prompt_logprobs: list[TokenLogprob | None] | None = None


Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **config) -> None:
        self.engine = Engine(EngineConfig(model=model, **config))
        self.tokenizer = self.engine.tokenizer
        freeze_startup_heap()  # no full collection pauses a long generate() on the model's objects

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (daemons: they also end with this process)."""
        self.engine.shutdown()

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        lora_name: str | None = None,
        use_tqdm: bool = True,
    ) -> list[list[float]]:
        """Each prompt's embedding: its final hidden states pooled as the model pools
        (the last token's, the first's or their mean), L2-normalized (engine/pooling.py)."""
        if self.engine.labels:
            raise ValueError("this model is a sequence classifier: use classify()")
        return self._pooled(prompts, lora_name, use_tqdm)

    def classify(
        self,
        prompts: Prompt | Sequence[Prompt],
        lora_name: str | None = None,
        use_tqdm: bool = True,
    ) -> list[list[float]]:
        """Each prompt's class probabilities, from a sequence classifier's head over its
        last token (an encoder's: its first; engine/pooling.py): the logits' softmax, or with one label their
        sigmoid. The classes' names are `engine.labels`."""
        if not self.engine.labels:
            raise ValueError("this model has no classification head")
        logits = np.asarray(self._pooled(prompts, lora_name, use_tqdm), dtype=np.float64)
        return class_probabilities(logits).tolist()

    def _pooled(
        self, prompts: Prompt | Sequence[Prompt], lora_name: str | None, use_tqdm: bool
    ) -> list[list[float]]:
        params = SamplingParams(
            max_tokens=1, temperature=0.0, pooling=True, detokenize=False, lora_name=lora_name
        )
        return [out.outputs[0].embedding for out in self.generate(prompts, params, use_tqdm)]

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[GenerationOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        # Only finished outputs are returned: the engine need not build per-step deltas.
        # One copy per distinct params object (one given for all prompts: one copy).
        distinct = {id(p): p for p in params}
        final = {key: dataclasses.replace(p, final_only=True) for key, p in distinct.items()}
        params = [final[id(p)] for p in params]

        # Validate everything first, so a bad prompt fails before any work is done.
        token_ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        for ids, p in zip(token_ids, params):
            self.engine.check_request(ids, p)
            if p.grammar is not None:
                build_grammar(p.grammar)  # raises for an invalid one

        results: dict[str, GenerationOutput] = {}
        for i, (prompt, ids, p) in enumerate(zip(prompts, token_ids, params)):
            rid = str(i)
            results[rid] = GenerationOutput(
                rid,
                prompt if isinstance(prompt, str) else None,
                ids,
                [CompletionOutput(j) for j in range(p.n)],
            )
            self.engine.add_request(rid, ids, p)

        with tqdm(total=len(prompts), desc="generate", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    result = results[out.request_id]
                    choice = result.outputs[out.index]
                    choice.text += out.new_text
                    choice.token_ids += out.new_token_ids
                    if out.new_logprobs is not None:
                        choice.logprobs = (choice.logprobs or []) + out.new_logprobs
                    result.num_cached_tokens = out.num_cached_tokens
                    if out.prompt_logprobs is not None:
                        result.prompt_logprobs = out.prompt_logprobs
                    if out.finished:
                        choice.finish_reason = out.finish_reason
                        choice.stop_reason = out.stop_reason
                        choice.embedding = out.embedding
                        if all(c.finish_reason for c in result.outputs):
                            bar.update(1)
        return [results[str(i)] for i in range(len(prompts))]
