"""Offline API: LLM(model=...).generate(prompts, params) -> completed outputs; .chat(messages)
through the chat template (the server's rendering, server/prompts.py)."""

from __future__ import annotations

import base64
import dataclasses
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


# Text, token ids, or vLLM's dict prompts (LLM.generate says which).
Prompt = str | list[int] | dict[str, Any]


@dataclass
class PromptInputs:
    """A prompt as the engine takes it."""

    token_ids: list[int]
    text: str | None = None  # the prompt's text, where it came as text
    images: ImageInputs | None = None


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`: generate with the PEFT
    adapter at lora_path, loaded as lora_name on first use (the LLM needs enable_lora)."""

    lora_name: str
    lora_int_id: int = 0  # vLLM's number for it; adapters are told apart by name here
    lora_path: str = ""


Conversation = list[dict[str, Any]]  # OpenAI chat messages
# Requests whose images go through the vision tower together as LLM.chat adds them.
PREFETCH_REQUESTS = 64


class LLM:
    def __init__(self, model: str | None = None, **config) -> None:
        engine_config = EngineConfig(model=model, **config)
        engine_config.offline_step_budget()
        self.engine = Engine(engine_config)
        self.tokenizer = self.engine.tokenizer
        self._prompts: Prompts | None = None  # chat()'s rendering, made on first use
        self._requested: list[str] = []  # adapters a LoRARequest loaded, least recent first
        freeze_startup_heap()  # no full collection pauses a long generate() on the model's objects

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (daemons: they also end with this process)."""
        self.engine.shutdown()

    def load_lora(self, name: str, path: str, load_inplace: bool = False) -> None:
        """Serve the PEFT adapter at path as `name` (SamplingParams.lora_name) from now on;
        needs enable_lora, and a free slot of max_loras. load_inplace: a loaded `name`
        gets these weights instead (vLLM's)."""
        self.engine.load_lora(name, path, load_inplace)

    def unload_lora(self, name: str) -> None:
        self.engine.unload_lora(name)

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
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[GenerationOutput]:
        """prompts: text, token ids, or vLLM's dicts: `{"prompt": text}` or
        `{"prompt_token_ids": ids}`, and with text, `"multi_modal_data": {"image": PIL
        image or list}` for a model that reads images, the text holding the model's image
        placeholder where each goes (as its processor expects). lora_request: one for
        every prompt or one each (see LoRARequest)."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run([self._inputs(p) for p in prompts], params, use_tqdm, lora_request)

    def _inputs(self, prompt: Prompt) -> PromptInputs:
        if isinstance(prompt, str):
            return PromptInputs(self.tokenizer.encode(prompt), prompt)
        if not isinstance(prompt, dict):
            return PromptInputs(list(prompt))
        if set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"} or (
            "prompt" in prompt
        ) == ("prompt_token_ids" in prompt):
            raise ValueError(
                "A dict prompt holds prompt or prompt_token_ids, and may hold multi_modal_data."
            )
        data = prompt.get("multi_modal_data") or {}
        if not data:
            return self._inputs(prompt.get("prompt", prompt.get("prompt_token_ids")))
        if set(data) != {"image"} or "prompt" not in prompt:
            raise ValueError("multi_modal_data takes images only, beside a text prompt.")
        processor = self._chat_prompts().images
        if processor is None:
            raise ValueError("This model reads no images.")
        from server.errors import APIError
        from server.images import png_bytes

        pictures = data["image"] if isinstance(data["image"], list) else [data["image"]]
        blobs = [png_bytes(picture) for picture in pictures]
        try:  # the text's own special tokens, as a text prompt's
            out = processor.process(prompt["prompt"], blobs, add_special_tokens=True)
        except APIError as exc:
            raise ValueError(exc.message) from exc
        return PromptInputs(out.token_ids, prompt["prompt"], out.images)

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
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
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
        inputs = [PromptInputs(p.token_ids, None, p.images) for p in rendered]
        return self._run(inputs, sampling_params, use_tqdm, lora_request)

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
        inputs: list[PromptInputs],
        params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[GenerationOutput]:
        params = params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(inputs)
        if len(params) != len(inputs):
            raise ValueError(f"{len(inputs)} prompts but {len(params)} sampling params")
        if lora_request is not None:
            params = self._with_adapters(params, lora_request)
        # Only finished outputs are returned: the engine need not build per-step deltas.
        # One copy per distinct params object (one given for all prompts: one copy).
        distinct = {id(p): p for p in params}
        final = {key: dataclasses.replace(p, final_only=True) for key, p in distinct.items()}
        params = [final[id(p)] for p in params]

        # Validate everything first, so a bad prompt fails before any work is done.
        for prompt, p in zip(inputs, params):
            self.engine.check_request(prompt.token_ids, p)
            if p.grammar is not None:
                build_grammar(p.grammar)  # raises for an invalid one

        results: dict[str, GenerationOutput] = {}
        vision = self.engine.vision
        for i, (prompt, p) in enumerate(zip(inputs, params)):
            if vision is not None and i % PREFETCH_REQUESTS == 0:
                # The next requests' images through the tower in one call per shape.
                ahead = inputs[i : i + PREFETCH_REQUESTS]
                vision.prefetch([x.images for x in ahead if x.images is not None])
            rid, ids = str(i), prompt.token_ids
            outputs = [CompletionOutput(j) for j in range(p.n)]
            results[rid] = GenerationOutput(rid, prompt.text, ids, outputs)
            self.engine.add_request(rid, ids, p, images=prompt.images)
        if vision is not None:
            vision.forget()

        with tqdm(total=len(inputs), desc="generate", disable=not use_tqdm) as bar:
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
        return [results[str(i)] for i in range(len(inputs))]

    def _with_adapters(
        self,
        params: list[SamplingParams],
        lora_request: LoRARequest | Sequence[LoRARequest | None],
    ) -> list[SamplingParams]:
        """Each prompt's params naming its LoRARequest's adapter, loaded first where it is
        not: into a free slot, else over the least recently requested adapter this call
        does not use (between calls no request runs, so its slot is free)."""
        requests = lora_request
        if isinstance(requests, LoRARequest):
            requests = [requests] * len(params)
        if len(requests) != len(params):
            raise ValueError(f"{len(params)} prompts but {len(requests)} LoRA requests")
        wanted = {r.lora_name: r.lora_path for r in requests if r is not None}
        slots = self.engine.runner.lora_slots
        for name, path in wanted.items():
            served = {a.name: a.path for a in (slots.served if slots else ())}
            if name in served:
                if path and path != served[name]:
                    raise ValueError(f"LoRA adapter {name!r} is loaded from {served[name]}")
            else:
                idle = [n for n in self._requested if n not in wanted]
                if slots is not None and len(served) >= slots.state.slots and idle:
                    self.engine.unload_lora(idle[0])
                    self._requested.remove(idle[0])
                self.engine.load_lora(name, path)  # LoRAError: why it cannot
                self._requested.append(name)
            if name in self._requested:  # the most recently requested last
                self._requested.remove(name)
                self._requested.append(name)
        return [
            p if r is None else dataclasses.replace(p, lora_name=r.lora_name)
            for p, r in zip(params, requests, strict=True)
        ]


def _pil_as_url(message: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `{"type": "image_pil", "image_pil": <PIL image>}` parts as PNG data URLs."""
    content = message.get("content")
    if not isinstance(content, list) or all(part.get("type") != "image_pil" for part in content):
        return message
    parts = []
    for part in content:
        if part.get("type") == "image_pil":
            from server.images import png_bytes

            url = "data:image/png;base64," + base64.b64encode(png_bytes(part["image_pil"])).decode()
            part = {"type": "image_url", "image_url": {"url": url}}
        parts.append(part)
    return {**message, "content": parts}
