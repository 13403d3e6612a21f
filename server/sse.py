"""Streamed answers as server-sent events: each payload a `data:` event, an error event if
generation fails midway, `[DONE]` last; the request is aborted however the response ends."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from server.errors import APIError, error_body
from server.request_stream import RequestStream

logger = logging.getLogger("pagoda.server")


async def _sse_events(stream: RequestStream, payloads: AsyncIterator[str]) -> AsyncIterator[str]:
    """`data: {json}` events, an error event if generation fails midway, `[DONE]` last."""
    try:
        async for payload in payloads:
            yield f"data: {payload}\n\n"
    except APIError as exc:
        yield f"data: {json.dumps(exc.body())}\n\n"
    except Exception:
        logger.exception("stream failed")  # the text stays in the log, not in the stream
        yield f"data: {json.dumps(error_body('Internal server error.', 500))}\n\n"
    finally:
        stream.abort()  # a no-op when finished; frees the engine's blocks when cancelled
    yield "data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """The payloads as SSE events; aborts the request however the response ends, even if
    streaming never began."""

    def __init__(self, stream: RequestStream, payloads: AsyncIterator[str]) -> None:
        super().__init__(
            _sse_events(stream, payloads),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.request_stream = stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.request_stream.abort()
