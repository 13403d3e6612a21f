"""The one check of a request against the model's limits, before any work is done.

Pure (no torch): the engine runs it in add_request, and the server runs it in
the API process, where a bad request becomes a 400 before it is queued. One set
of messages, in the words OpenAI uses, so that clients that parse "maximum
context length" see the same text whichever side caught it.
"""

from __future__ import annotations

from engine.sampling_params import SamplingParams

# An encoder's prompt id with a token type (BERT's segment id: 1 on a cross-encoder
# pair's second text) is token | token_type << TOKEN_TYPE_SHIFT, as vLLM packs them; the
# model's embedding unpacks them (engine/models/bert.py).
TOKEN_TYPE_SHIFT = 30


class RequestRejected(ValueError):
    """A request that can never run; `param` names the request field at fault
    ("prompt" for the prompt, whatever the API called it)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class UnknownAdapter(ValueError):
    """A LoRA adapter name that is not loaded (engine/models/lora_slots.py)."""


def out_of_vocab(token_ids: list[int], vocab_size: int, token_types: int = 1) -> int | None:
    """The first id outside [0, vocab_size) (with token_types > 1, whose token or type
    is out of range), or None; min/max first, since a scan in Python costs tens of ns
    an id, paid on every request's prompt."""
    if not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size):
        return None
    mask = (1 << TOKEN_TYPE_SHIFT) - 1 if token_types > 1 else -1
    return next(
        (
            t
            for t in token_ids
            if not (0 <= t & mask < vocab_size and 0 <= t >> TOKEN_TYPE_SHIFT < token_types)
        ),
        None,
    )


def check_request(
    prompt_token_ids: list[int],
    params: SamplingParams,
    max_model_len: int,
    vocab_size: int,
    token_types: int = 1,  # an encoder's type_vocab_size: its ids may carry a type
) -> None:
    """Raise RequestRejected for a request that can never run (any thread, any process)."""
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        raise RequestRejected("The prompt is empty.", "prompt")
    bad = out_of_vocab(prompt_token_ids, vocab_size, token_types)
    if bad is not None:
        raise RequestRejected(
            f"Token id {bad} is out of vocabulary (vocabulary size {vocab_size}).", "prompt"
        )
    try:
        params.check_vocab(vocab_size)
    except ValueError as exc:  # "stop_token_ids has token id ..." / "logit_bias has ..."
        raise RequestRejected(str(exc), str(exc).split(" ", 1)[0]) from None
    if params.pooling:  # its one "sampled" token is never computed: the prompt may fill it
        if num_prompt > max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {max_model_len} tokens, but the "
                f"input has {num_prompt} tokens.",
                "prompt",
            )
        return
    if num_prompt >= max_model_len:
        raise RequestRejected(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt "
            f"has {num_prompt} tokens, leaving no room for the completion.",
            "prompt",
        )
    if params.max_tokens is not None and num_prompt + params.max_tokens > max_model_len:
        raise RequestRejected(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt + params.max_tokens} tokens ({num_prompt} in the prompt, "
            f"{params.max_tokens} for the completion). Reduce the prompt or max_tokens.",
            "max_tokens",
        )
    if num_prompt + params.min_tokens > max_model_len:
        raise RequestRejected(
            f"This model's maximum context length is {max_model_len} tokens, but min_tokens "
            f"({params.min_tokens}) with the prompt ({num_prompt} tokens) needs "
            f"{num_prompt + params.min_tokens}.",
            "min_tokens",
        )
