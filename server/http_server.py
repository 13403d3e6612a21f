"""uvicorn as Pagoda runs it: slow clients timed out, connections capped, and a
shutdown that ends every open stream with an error event instead of cutting it.

uvicorn closes idle keep-alive connections, but not one that never finishes its
request (silent, slowloris, or a body never completed), which holds a socket
forever. The protocol below closes a connection whose headers are not complete
`header_timeout` seconds after it opened (or after its previous response), or
whose body is not complete `body_timeout` seconds after its headers; past
`max_connections` open connections it answers 503 and closes.

On SIGTERM uvicorn stops accepting, then waits for open requests. After
`shutdown_timeout` seconds every stream still open fails with a 503 error event
(or body), so that each ends cleanly before uvicorn's own deadline cancels it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from server.config import ServerConfig
from server.errors import APIError, error_body

# What uvicorn adds to our grace period: time for the error events to go out.
_DRAIN_MARGIN_S = 5.0


def guarded_protocol(config: ServerConfig) -> type[HttpToolsProtocol]:
    body = json.dumps(error_body("Too many open connections.", 503)).encode()
    too_many = (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )

    class GuardedHttpTools(HttpToolsProtocol):
        _timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > config.max_connections:
                transport.write(too_many)
                transport.close()
                return
            self._arm(config.header_timeout)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():  # kept alive: the next request's headers
                self._arm(config.header_timeout)

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._arm(config.body_timeout)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, self.transport.close)

        def _disarm(self) -> None:
            if self._timer is not None:  # cancelling a fired or cancelled timer is harmless
                self._timer.cancel()

    return GuardedHttpTools


def uvicorn_config(app: Any, server_config: ServerConfig) -> uvicorn.Config:
    """uvicorn's settings for serving `app` (one API process's, when there are several)."""
    return uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        log_level=server_config.log_level,
        access_log=server_config.access_log,
        http=guarded_protocol(server_config),
        timeout_keep_alive=int(server_config.timeout_keep_alive),
        timeout_graceful_shutdown=int(server_config.shutdown_timeout + _DRAIN_MARGIN_S),
    )


class DrainingServer(uvicorn.Server):
    """A uvicorn server for `app` (server.app.create_app) that, once shutting down for
    shutdown_timeout seconds, fails the app's open streams."""

    def __init__(self, app: Any, server_config: ServerConfig) -> None:
        super().__init__(uvicorn_config(app, server_config))
        self._app, self._grace = app, server_config.shutdown_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        deadline = asyncio.get_running_loop().call_later(self._grace, self._drain)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    def _drain(self) -> None:
        self._app.state.async_engine.fail_streams(APIError("The server is shutting down.", 503))


def serve_app(app: Any, server_config: ServerConfig, sockets: list[socket.socket] | None) -> bool:
    """Serve until SIGINT or SIGTERM and a drain; True if the server had started.

    uvicorn re-raises the signal it stopped on once done; with SIGTERM's default
    action that would end the process as killed (exit -15) after a clean drain.
    Here it finds a handler that ignores it, so every layout exits 0."""
    server = DrainingServer(app, server_config)
    signal.signal(signal.SIGTERM, lambda *_: None)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C, re-raised by uvicorn likewise
        server.run(sockets=sockets)
    return server.started
