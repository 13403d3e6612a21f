"""The OpenAI error body, and the exception that carries one out of a handler."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi.responses import JSONResponse

# The `type` OpenAI uses for each status we answer with.
_TYPES = {401: "authentication_error", 500: "server_error", 503: "server_error"}

# Sampling fields whose names hold no underscore (the rest are recognised by theirs).
_ONE_WORD_PARAMS = {"temperature", "n", "stop", "seed", "logprobs", "prompt", "messages"}


def error_body(
    message: str, status: int = 400, param: str | None = None, code: str | None = None
) -> dict:
    """`{"error": {"message", "type", "param", "code"}}`, as OpenAI sends it."""
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


@dataclass(eq=False)  # compared and hashed as the exception it is
class APIError(Exception):
    """Raised anywhere below a route; the app's handler turns it into the error body."""

    message: str
    status: int = 400
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict:
        return error_body(self.message, self.status, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_value_error(exc: ValueError) -> APIError:
    """A 400 for a ValueError from SamplingParams or the engine.

    Their messages start with the offending field's name ("top_p must be in (0, 1]"),
    which becomes `param`.
    """
    message = str(exc)
    first = message.split(" ", 1)[0]
    is_param = first in _ONE_WORD_PARAMS or (first.isidentifier() and "_" in first)
    return APIError(message, 400, param=first if is_param else None)
