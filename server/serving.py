"""What completions and chat share: model checks, prompt limits, sampling params,
and the two ways of answering (one JSON body, or SSE)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request

from engine.checks import RequestRejected, check_request
from engine.generation_config import load_generation_config
from engine.images import vision_family
from engine.request import RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.structured.spec import GrammarSpec
from server.async_engine import AsyncEngine
from server.config import ServerConfig
from server.errors import APIError, from_value_error
from server.images import ImageProcessor, MediaAccess
from server.prompts import Prompts, unless_disconnected
from server.protocol import (
    ChatMessage,
    ChatTemplateOptions,
    DetokenizeRequest,
    SamplingRequest,
    TokenizeRequest,
)
from server.reasoning import default_parser
from server.replies import (
    DetokenizeResponse,
    ModelCard,
    ModelList,
    PromptLogprob,
    PromptTokensDetails,
    TokenizeResponse,
    UsageInfo,
)
from server.request_stream import RequestStream, coalesce

if TYPE_CHECKING:
    from engine.models.lora_slots import ServedAdapter

logger = logging.getLogger("pagoda.server")
# Sampling fields whose null means SamplingParams' default.
_OPTIONAL_SAMPLING = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty",
)  # fmt: skip


class Usage:
    """Counts prompt tokens once per prompt and completion tokens once per choice."""

    def __init__(self) -> None:
        self._prompt: dict[str, tuple[int, int]] = {}  # (prompt tokens, cached ones)
        self._completion: dict[tuple[str, int], int] = {}

    def add(self, out: RequestOutput) -> None:
        self._prompt[out.request_id] = out.num_prompt_tokens, out.num_cached_tokens
        self._completion[(out.request_id, out.index)] = out.num_output_tokens

    def info(self) -> UsageInfo:
        prompt = sum(n for n, _ in self._prompt.values())
        cached = sum(c for _, c in self._prompt.values())
        completion = sum(self._completion.values())
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )


class Serving:
    """Holds the engine bridge and the prompts' tokenizer lanes; shared by the routes."""

    def __init__(self, async_engine: AsyncEngine, config: ServerConfig) -> None:
        info = async_engine.info
        assert info is not None, "the engine has not started"
        # Finds calls in the output for tool_choice "auto" (None: auto is refused).
        self.tool_call_parser = config.tool_call_parser if config.enable_auto_tool_choice else None
        self.reasoning_parser = config.reasoning_parser or default_parser(info.model_dir)
        # What a request's null sampling fields become (OpenAI's defaults where empty).
        self.sampling_defaults: dict[str, float] = {}
        # A chat request's max_tokens when it sets none (None: up to the context's end).
        self.default_max_tokens: int | None = None
        if config.generation_config == "auto":
            generation = load_generation_config(info.model_dir)
            self.sampling_defaults = generation.sampling
            self.default_max_tokens = generation.max_new_tokens
        defaults = self.sampling_defaults | {"max_new_tokens": self.default_max_tokens}
        if any(v is not None for v in defaults.values()):
            logger.info(
                "defaults from the model's generation_config.json: %s "
                "(--generation-config vllm for OpenAI's)",
                ", ".join(f"{k}={v}" for k, v in defaults.items() if v is not None),
            )
        self.async_engine = async_engine
        self.model_name = config.served_model_name or info.model_name
        self._served: tuple[ServedAdapter, ...] | None = None  # lora_modules' source
        self._lora_modules: dict[str, str] = {}
        # Adapters can come while serving (/v1/load_lora_adapter, maybe another process's).
        self.adapters_change = config.allow_runtime_lora_updating
        self.max_model_len = info.max_model_len
        self.by_priority = info.config.scheduling_policy == "priority"
        self.vocab_size = info.vocab_size
        self.hidden_size = info.hidden_size
        self.can_generate = info.can_generate
        self.labels = info.labels  # a sequence classifier's, by class index
        self.token_types = info.token_types
        if config.chat_template is not None:  # before the prompt lanes copy the tokenizer
            info.tokenizer.chat_template = config.chat_template
        family = vision_family(info.model_dir)
        images = None
        if family:
            access = MediaAccess.of(config.allowed_media_domains, config.allowed_local_media_path)
            limit = config.max_images_per_prompt
            images = ImageProcessor(info.model_dir, family, info.tokenizer, limit, access)
        self.prompts = Prompts(
            info.tokenizer, self.max_model_len, self.token_types, images,
            config.trust_request_chat_template,
        )  # fmt: skip

    async def admit(self, model: str | None, task: str = "generate") -> None:
        """What a request for the engine is checked for before any work: the model it
        names, that the model does the task ("generate", "embed", "score": an embedding
        model's or a one-label classifier's, or "classify"), and room in the waiting queue
        (a 503 with Retry-After)."""
        await self.check_model(model)
        classifies = bool(self.labels)
        cross_encodes = task == "score" and len(self.labels) == 1
        if task != "classify" and classifies and not cross_encodes:
            raise APIError(
                "This model is a sequence classifier: it serves /classify only (and, with "
                "one label, /v1/score and /v1/rerank).",
                param="model",
            )
        if task == "generate" and not self.can_generate:
            raise APIError(
                "This model has no LM head: it serves /v1/embeddings only.", param="model"
            )
        if task == "classify" and not classifies:
            raise APIError(
                "This model has no classification head (a *ForSequenceClassification "
                "checkpoint's): /classify is not served.",
                param="model",
            )
        self.async_engine.check_capacity()

    @property
    def lora_modules(self) -> dict[str, str]:
        """The LoRA adapters served now, each as a model of its own name (name -> its
        directory): the engine's, as its last report says."""
        stats = self.async_engine.stats
        served = stats.lora_adapters if stats is not None else ()
        if served != self._served:
            self._served, self._lora_modules = served, {a.name: a.path for a in served}
        return self._lora_modules

    async def check_model(self, model: str | None) -> None:
        if model is None or model == self.model_name or model in self.lora_modules:
            return
        if self.adapters_change:
            # Another API process may have loaded it since this one's last report: the
            # answer to a sync comes after every report made before it.
            await self.async_engine.sync()
            if model in self.lora_modules:
                return
        raise APIError(
            f"The model `{model}` does not exist.", 404, param="model", code="model_not_found"
        )

    def lora_name(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model)."""
        return model if model in self.lora_modules else None

    def answering(self, model: str | None) -> str:
        """The `model` a response names: the adapter asked for, else the base model."""
        return self.lora_name(model) or self.model_name

    def token_names(self, req: SamplingRequest) -> Callable[[int], str]:
        """How logprobs name a token: its text, or "token_id:{id}" where the request asks
        (vLLM's return_tokens_as_token_ids: a token whose bytes are no UTF-8 text alone
        stays identifiable)."""
        return _token_id_name if req.return_tokens_as_token_ids else self.prompts.token_text

    def check_prompt(
        self, ids: list[int], params: SamplingParams, param: str, truncate: int | None = None
    ) -> list[int]:
        """The prompt as the engine gets it (its last `truncate` tokens, if asked), after
        the engine's own check (engine/checks.py), as a 400 naming the field."""
        if truncate is not None:
            ids = ids[-truncate:]
        try:  # on a tokenizer lane wherever bad_words are given (their callers see to it)
            params.with_bad_words(lambda text: self.prompts.encode(text, add_special_tokens=False))
        except ValueError as exc:  # "bad_words entry ' ' has no tokens"
            raise from_value_error(exc) from exc
        try:
            check_request(ids, params, self.max_model_len, self.vocab_size, self.token_types)
        except RequestRejected as exc:
            raise APIError(str(exc), param=param if exc.param == "prompt" else exc.param) from None
        return ids

    def prompt_ids(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        param: str,
        truncate: int | None,
        add_special_tokens: bool,
    ) -> list[int]:
        """A text or token-id prompt as the engine gets it (check_prompt); a text too long
        for the context is refused before it is tokenized, unless it is to be truncated
        (by the tokenizer, which keeps its special tokens: Prompts.encode)."""
        if isinstance(prompt, str):
            if truncate is None:
                self.prompts.check_length(prompt, param)
            prompt = self.prompts.encode(prompt, add_special_tokens, truncate)
        return self.check_prompt(prompt, params, param, truncate)

    def truncation(self, req: SamplingRequest) -> int | None:
        """truncate_prompt_tokens as a count (-1: max_model_len, vLLM's)."""
        k = req.truncate_prompt_tokens
        if k is None:
            return None
        if k == -1:
            return self.max_model_len
        if not 1 <= k <= self.max_model_len:
            raise APIError(
                f"truncate_prompt_tokens must be -1 or in [1, {self.max_model_len}], got {k}.",
                param="truncate_prompt_tokens",
            )
        return k

    def sampling_params(
        self,
        req: SamplingRequest,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        grammar: GrammarSpec | None = None,
    ) -> SamplingParams:
        """OpenAI fields → SamplingParams; its ValueErrors become 400s naming the field."""
        if req.stream_options is not None and not req.stream:
            raise APIError(
                "stream_options is only allowed when stream is true.", param="stream_options"
            )
        if req.priority and not self.by_priority:
            raise APIError(
                f"priority {req.priority} needs priority scheduling (--scheduling-policy "
                "priority).",
                param="priority",
            )
        optional = {k: getattr(req, k) for k in _OPTIONAL_SAMPLING}  # null: the default
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                n=req.n,
                seed=req.seed,
                stop=req.stop or [],
                stop_token_ids=req.stop_token_ids or [],
                logit_bias=req.logit_bias or None,  # its keys are JSON's strings: made ids there
                allowed_token_ids=req.allowed_token_ids,
                bad_words=req.bad_words or [],
                cache_salt=req.cache_salt,
                priority=req.priority,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                ignore_eos=req.ignore_eos,
                min_tokens=req.min_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
                grammar=grammar,
                lora_name=self.lora_name(req.model),
                **self.sampling_defaults | {k: v for k, v in optional.items() if v is not None},
            )
            params.check_vocab(self.vocab_size)
        except ValueError as exc:
            raise from_value_error(exc) from exc
        return params

    # ------------------------------------------------------------ answering

    async def collect(self, raw: Request, stream: RequestStream) -> list[RequestOutput]:
        """Every choice's whole result, as one output (its deltas merged, the last one's
        ending and counts); aborts the request if the client disconnects first."""

        async def consume() -> list[RequestOutput]:
            return coalesce([out async for outputs in stream for out in outputs])

        work = asyncio.ensure_future(consume())
        try:
            return await unless_disconnected(raw, work)
        finally:
            if not work.done():
                work.cancel()
                stream.abort()

    # ------------------------------------------------------------ small endpoints

    async def models(self) -> ModelList:
        if self.adapters_change:  # what every API process has loaded, up to now
            await self.async_engine.sync()
        return ModelList(data=self._cards())

    async def model(self, model_id: str) -> ModelCard:
        await self.check_model(model_id)
        return next(card for card in self._cards() if card.id == model_id)

    def _cards(self) -> list[ModelCard]:
        base = ModelCard(id=self.model_name, max_model_len=self.max_model_len)
        adapters = [
            ModelCard(id=name, root=path, parent=self.model_name, max_model_len=self.max_model_len)
            for name, path in self.lora_modules.items()
        ]
        return [base, *adapters]

    async def render_messages(
        self, raw: Request, messages: list[ChatMessage], options: ChatTemplateOptions
    ) -> list[int]:
        """The chat template's prompt ids for messages (no tools), on a prompt lane."""
        prompts, size = self.prompts, sum(len(str(m.content or "")) for m in messages)
        fetched = await prompts.fetch_images(raw, messages)
        prompt = await prompts.run(
            raw, size, lambda: prompts.render_chat(messages, options, fetched=fetched)
        )
        return prompt.token_ids

    async def tokenize(self, req: TokenizeRequest, raw: Request) -> TokenizeResponse:
        await self.check_model(req.model)
        prompts = self.prompts
        if (req.prompt is None) == (req.messages is None):
            raise APIError("Give either prompt or messages.", param="prompt")
        if req.messages is not None:
            ids = await self.render_messages(raw, req.messages, req)
        else:
            prompts.check_length(req.prompt, "prompt")
            ids = await prompts.run(
                raw, len(req.prompt), prompts.encode, req.prompt, req.add_special_tokens
            )
        strs = self.prompts.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(
            tokens=ids, count=len(ids), max_model_len=self.max_model_len, token_strs=strs
        )

    async def detokenize(self, req: DetokenizeRequest, raw: Request) -> DetokenizeResponse:
        await self.check_model(req.model)
        bad = next((t for t in req.tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(f"Token id {bad} is out of vocabulary.", param="tokens")
        prompts = self.prompts
        return DetokenizeResponse(prompt=await prompts.run(raw, 0, prompts.decode, req.tokens))

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's GET /tokenizer_info: the tokenizer's class and config, so that a client
        (lm-eval) can rebuild it without the hub."""
        tokenizer = self.prompts.tokenizer
        config = {
            k: v for k, v in tokenizer.init_kwargs.items() if _is_json(v) and k != "name_or_path"
        }
        special = {k: str(v) for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
        own = {
            "tokenizer_class": type(tokenizer).__name__,
            "chat_template": getattr(tokenizer, "chat_template", None),
            "model_max_length": self.max_model_len,
        }
        return config | special | own


def _token_id_name(token_id: int) -> str:
    return f"token_id:{token_id}"


def prompt_logprobs_out(
    s: Serving, entries: list[TokenLogprob | None]
) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's prompt_logprobs: per prompt token (the first has none), token id -> logprob,
    rank and text, for the prompt's own token and the k most likely."""
    out: list[dict[str, PromptLogprob] | None] = []
    text = s.prompts.token_text
    for lp in entries:
        if lp is None:
            out.append(None)
            continue
        entry = {
            str(lp.token_id): PromptLogprob(
                logprob=lp.logprob, rank=lp.rank, decoded_token=text(lp.token_id)
            )
        }
        for rank, (token_id, logprob) in enumerate(lp.top, start=1):
            entry.setdefault(
                str(token_id),
                PromptLogprob(logprob=logprob, rank=rank, decoded_token=text(token_id)),
            )
        out.append(entry)
    return out


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
