"""/openapi.json as the server behaves: every error is the OpenAI error body with a
4xx or 5xx (never FastAPI's 422), streams are text/event-stream, /metrics is text."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorResponse} for status in statuses}


# Every route can answer 401 (with --api-key) and 413 (a body over the limit).
COMMON = _errors(400, 401, 404, 413)
GENERATE = {
    **_errors(400, 401, 404, 413, 500, 503),
    200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}},
}
HEALTH = _errors(503)
METRICS = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}}}


def install(app: FastAPI) -> None:
    """Drop the 422 FastAPI documents for every body: validation errors are 400s."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
