"""vLLM's beam search (`use_beam_search`, completions and chat), run as vLLM runs it:
over the engine, a step at a time, each live beam a one-token request asking for the
2 x beam_width most likely next tokens. The prefix cache keeps a step's work to each
beam's last tokens.

A beam's score is its cumulative logprob / length ** length_penalty, the length counting
the prompt and not a final EOS (vLLM's get_beam_search_score). A chat's images go with
every beam's request (the prefix cache, salted by them, keeps the prompt's work). A candidate ending in EOS
is complete (unless ignore_eos); the best beam_width of the rest live on. After
max_tokens steps the best beam_width of the complete and the live beams are the choices,
best first, with finish reason "stop" (EOS) or "length". The beam width is `n`. The
answer comes whole at the end, streamed too (as vLLM). Sampling knobs (temperature,
top_p, top_k, min_p, seed) do not apply: the search is deterministic.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from fastapi import Request

from engine.detokenizer import IncrementalDetokenizer
from engine.images import ImageInputs
from engine.request import RequestMetrics, RequestOutput, TokenLogprob
from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from server.errors import APIError
from server.prompts import ClientDisconnected
from server.protocol import SamplingRequest
from server.request_stream import RequestStream
from server.serving import Serving

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # a step asks for 2 x beam_width candidates a beam
MAX_LENGTH_PENALTY = 10.0  # length ** penalty stays finite for any context length

logger = logging.getLogger("pagoda.server")


@dataclass
class Beam:
    tokens: list[int]  # generated so far (a complete beam's last is its EOS)
    logprobs: list[TokenLogprob]  # each token's, with the alternatives asked for
    cum_logprob: float = 0.0
    stopped: bool = False  # ended by EOS


def score(beam: Beam, prompt_len: int, length_penalty: float) -> float:
    length = prompt_len + len(beam.tokens) - beam.stopped
    return beam.cum_logprob / length**length_penalty


def check(req: SamplingRequest, params: SamplingParams) -> None:
    """400 for what a beam search cannot honor (n > MAX_BEAM_WIDTH, or an option that
    would change which tokens may come)."""
    if req.n > MAX_BEAM_WIDTH:
        raise APIError(
            f"n (the beam width) must be at most {MAX_BEAM_WIDTH} with use_beam_search.",
            param="n",
        )
    if not abs(req.length_penalty) <= MAX_LENGTH_PENALTY:  # NaN too
        raise APIError(
            f"length_penalty must be in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}].",
            param="length_penalty",
        )
    refused = {
        "stop": params.stop,
        "stop_token_ids": params.stop_token_ids,
        "bad_words": params.bad_words,
        "allowed_token_ids": params.allowed_token_ids,
        "logit_bias": params.logit_bias,
        "min_tokens": params.min_tokens,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty != 1.0,
        "structured outputs": params.grammar,
        "prompt_logprobs": params.prompt_logprobs is not None,
    }
    for name, value in refused.items():
        if value:
            raise APIError(
                f"{name} cannot be combined with use_beam_search.",
                param=name if " " not in name else "use_beam_search",
            )


def beam_stream(
    s: Serving,
    raw: Request,
    request_id: str,
    prompts: list[list[int]],
    params: SamplingParams,
    length_penalty: float,
    images: ImageInputs | None = None,  # a chat's (one prompt)
) -> RequestStream:
    """A stream that yields each prompt's n best beams (as choices 0..n-1) once searched."""
    width = params.n
    ids = [request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))]
    tokenizer = s.async_engine.info.tokenizer
    decoders = {
        (rid, i): IncrementalDetokenizer(tokenizer, prompt, params)
        for rid, prompt in zip(ids, prompts, strict=True)
        for i in range(width)
    }
    task: asyncio.Task | None = None
    stream = RequestStream(ids, width, decoders, False, lambda _: task and task.cancel())

    async def run() -> None:
        try:
            found = await asyncio.gather(
                *(
                    search(s, raw, rid, prompt, params, length_penalty, images)
                    for rid, prompt in zip(ids, prompts, strict=True)
                )
            )
            stream.push(stream.decode([out for outs in found for out in outs]))
        except APIError as exc:
            stream.push(exc)
        except ClientDisconnected:
            pass  # nobody reads the stream
        except Exception:  # the client gets an error, never a stream that does not end
            logger.exception("beam search failed")
            stream.push(APIError("Internal server error.", 500))

    task = asyncio.ensure_future(run())
    return stream


async def search(
    s: Serving,
    raw: Request | None,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    length_penalty: float,
    images: ImageInputs | None = None,
) -> list[RequestOutput]:
    """One prompt's beam search: its n best beams as finished outputs, best first."""
    arrival = time.time()
    width, eos = params.n, s.async_engine.info.eos_token_ids
    stop_at_eos = not params.ignore_eos
    # Each beam's step: its next token's 2 x width most likely (and the alternatives the
    # request asks for), from the raw logprobs.
    step = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        logprobs=max(2 * width, params.logprobs or 0),
        ignore_eos=True,
        detokenize=False,
        lora_name=params.lora_name,
        cache_salt=params.cache_salt,
        priority=params.priority,
    )
    live, done = [Beam([], [])], []
    room = s.max_model_len - len(prompt)
    for n in range(min(params.max_tokens or room, room)):
        stream = s.async_engine.submit(
            f"{request_id}-beam{n}", [prompt + beam.tokens for beam in live], step, images
        )
        outs = {out.request_id: out for out in await s.collect(raw, stream)}
        candidates = []
        for rid, beam in zip(stream.request_ids, live, strict=True):
            (choice,) = outs[rid].new_logprobs
            for rank, (token, logprob) in enumerate(choice.top[: 2 * width], start=1):
                kept = TokenLogprob(token, logprob, rank, choice.top[: params.logprobs or 0])
                grown = Beam(
                    beam.tokens + [token], beam.logprobs + [kept], beam.cum_logprob + logprob
                )
                if stop_at_eos and token in eos:
                    grown.stopped = True
                    done.append(grown)
                else:
                    candidates.append(grown)
        candidates.sort(key=lambda b: score(b, len(prompt), length_penalty), reverse=True)
        live = candidates[:width]
        if not live:
            break
    best = sorted(done + live, key=lambda b: score(b, len(prompt), length_penalty), reverse=True)
    now = time.time()
    metrics = RequestMetrics(arrival, arrival, now, now)
    outputs = []
    for index, beam in enumerate(best[:width]):
        tokens, logprobs = beam.tokens, beam.logprobs
        if beam.stopped and not params.include_stop_str_in_output:
            tokens, logprobs = tokens[:-1], logprobs[:-1]
        outputs.append(
            RequestOutput(
                request_id,
                index,
                tokens,
                "",
                logprobs if params.logprobs is not None else None,
                True,
                "stop" if beam.stopped else "length",
                beam.tokens[-1] if beam.stopped else None,
                len(prompt),
                len(tokens),
                0,
                metrics,
                hide_last_token=beam.stopped and params.include_stop_str_in_output,
            )
        )
    return outputs
