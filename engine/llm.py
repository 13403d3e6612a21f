"""Offline API: LLM(model=...).generate(prompts, params) -> completed outputs; .chat(messages)
through the chat template (the server's rendering, server/prompts.py)."""

from __future__ import annotations

import base64
import dataclasses
import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from engine.classification import class_probabilities
from engine.config import EngineConfig
from engine.engine import Engine
from engine.heap import freeze_startup_heap
from engine.images import ImageInputs, vision_family
from engine.request import TokenLogprob
from engine.sampling_params import SamplingParams
from engine.structured.spec import build_grammar

if TYPE_CHECKING:
    from server.prompts import Prompts


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
Conversation = list[dict[str, Any]]  # OpenAI chat messages
# Requests whose images go through the vision tower together as LLM.chat adds them.
PREFETCH_REQUESTS = 64


class LLM:
    def __init__(self, model: str | None = None, **config) -> None:
        self.engine = Engine(EngineConfig(model=model, **config))
        self.tokenizer = self.engine.tokenizer
        self._prompts: Prompts | None = None  # chat()'s rendering, made on first use
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
        token_ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        return self._run(token_ids, texts, [None] * len(prompts), params, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[GenerationOutput]:
        """vLLM's `LLM.chat`: each conversation (OpenAI chat messages; one conversation,
        or a list of them) through the model's chat template, or `chat_template`, then
        generated from as `generate` does; tools are shown to the template as given.
        A model that reads images takes `image_url` parts (data, http(s) and file://
        URLs: this process reads its own files) and vLLM's `image_pil` parts."""
        from server.errors import APIError
        from server.protocol import ChatMessage, ChatTemplateOptions

        if messages and isinstance(messages[0], dict):
            messages = [messages]
        options = ChatTemplateOptions(
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
        )
        prompts = self._chat_prompts()
        try:
            rendered = [
                prompts.render_chat(
                    [ChatMessage.model_validate(_pil_as_url(m)) for m in conversation],
                    options,
                    tools,
                    chat_template,
                )
                for conversation in messages
            ]
        except APIError as exc:
            raise ValueError(exc.message) from exc
        images = [prompt.images for prompt in rendered]
        return self._run([p.token_ids for p in rendered], [None] * len(rendered), images,
                         sampling_params, use_tqdm)  # fmt: skip

    def _chat_prompts(self) -> Prompts:
        """The server's chat rendering, made once: its image processor with file:// URLs
        read anywhere (the caller's own files)."""
        if self._prompts is None:
            from server.images import ImageProcessor, MediaAccess
            from server.prompts import Prompts

            engine = self.engine
            family = vision_family(engine.model_dir)
            images = None
            if family:
                access = MediaAccess(allowed_local_media_path=Path("/"))
                images = ImageProcessor(engine.model_dir, family, self.tokenizer, None, access)
            self._prompts = Prompts(self.tokenizer, engine.config.max_model_len, 1, images)
        return self._prompts

    def _run(
        self,
        token_ids: list[list[int]],
        texts: list[str | None],
        images: list[ImageInputs | None],
        params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[GenerationOutput]:
        params = params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(token_ids)
        if len(params) != len(token_ids):
            raise ValueError(f"{len(token_ids)} prompts but {len(params)} sampling params")
        # Only finished outputs are returned: the engine need not build per-step deltas.
        # One copy per distinct params object (one given for all prompts: one copy).
        distinct = {id(p): p for p in params}
        final = {key: dataclasses.replace(p, final_only=True) for key, p in distinct.items()}
        params = [final[id(p)] for p in params]

        # Validate everything first, so a bad prompt fails before any work is done.
        for ids, p in zip(token_ids, params):
            self.engine.check_request(ids, p)
            if p.grammar is not None:
                build_grammar(p.grammar)  # raises for an invalid one

        results: dict[str, GenerationOutput] = {}
        vision = self.engine.vision
        for i, (ids, text, p, pixels) in enumerate(zip(token_ids, texts, params, images)):
            if vision is not None and i % PREFETCH_REQUESTS == 0:
                # The next requests' images through the tower in one call per shape.
                vision.prefetch([x for x in images[i : i + PREFETCH_REQUESTS] if x is not None])
            rid = str(i)
            results[rid] = GenerationOutput(
                rid, text, ids, [CompletionOutput(j) for j in range(p.n)]
            )
            self.engine.add_request(rid, ids, p, images=pixels)
        if vision is not None:
            vision.forget()

        with tqdm(total=len(token_ids), desc="generate", disable=not use_tqdm) as bar:
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
        return [results[str(i)] for i in range(len(token_ids))]


def _pil_as_url(message: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `{"type": "image_pil", "image_pil": <PIL image>}` parts as PNG data URLs."""
    content = message.get("content")
    if not isinstance(content, list) or all(part.get("type") != "image_pil" for part in content):
        return message
    parts = []
    for part in content:
        if part.get("type") == "image_pil":
            buf = io.BytesIO()
            part["image_pil"].save(buf, format="PNG")
            url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
            part = {"type": "image_url", "image_url": {"url": url}}
        parts.append(part)
    return {**message, "content": parts}
