"""Pure-ASGI guards and stamps around every request: API key, body size, request id."""

from __future__ import annotations

import contextlib
import hmac
import uuid

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import error_body

# What --api-key protects; /health and /metrics stay open for probes and scrapers, and
# /dashboard for a browser (the page holds no data: it asks for the key).
_PROTECTED_PREFIXES = (
    "/v1",
    "/v2",
    "/score",
    "/rerank",
    "/tokenize",
    "/detokenize",
    "/dashboard/info",
)


class ApiKeyAuth:
    """`Authorization: Bearer KEY` (the scheme in any case, as RFC 9110 has it)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(_PROTECTED_PREFIXES):
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self._key):
                body = error_body("Incorrect API key provided.", 401, code="invalid_api_key")
                headers = {"WWW-Authenticate": "Bearer"}
                await JSONResponse(body, status_code=401, headers=headers)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestId:
    """X-Request-Id on every response: the client's own, or a new one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id")
        # Echoed only if it is a plain token: never a header injection.
        if given is None or not 0 < len(given) <= 256 or not all(32 < b < 127 for b in given):
            given = uuid.uuid4().hex.encode()

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", given)]
            await send(message)

        await self.app(scope, receive, stamped)


class _TooLarge(Exception):
    pass


class BodySizeLimit:
    """413 for bodies over the cap: declared (Content-Length) or streamed (chunked)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit():
            if int(declared) > self.max_bytes:
                await self._reject(scope, receive, send)
            else:  # the server reads no more than declared: no wrappers on every chunk sent
                await self.app(scope, receive, send)
            return

        received = 0
        too_large = False

        async def counting_receive() -> Message:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    too_large = True
                    raise _TooLarge
            return message

        async def guarded_send(message: Message) -> None:
            if not too_large:  # the app may turn _TooLarge into its own 400: drop it
                await send(message)

        with contextlib.suppress(_TooLarge):
            await self.app(scope, counting_receive, guarded_send)
        if too_large:
            await self._reject(scope, receive, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = error_body(f"The request body is larger than {self.max_bytes} bytes.", 413)
        await JSONResponse(body, status_code=413)(scope, receive, send)
