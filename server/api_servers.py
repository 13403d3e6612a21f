"""`--api-server-count N`: N API processes, one port, one engine process (vLLM's layout).

With `--engine-process` the engine has a core of its own, and the single API
process becomes the limit: HTTP parsing, SSE chunks and metrics for every
stream run on one event loop, one core. Here a supervisor binds N listening
sockets on the one port (SO_REUSEPORT: the kernel spreads connections over
them) and spawns the engine process and N API processes; each API process
accepts from its socket, talks to the engine over its own pair of pipes
(server/engine_process.py), and keeps its metrics in its row of a shared
buffer, so /metrics from any of them covers all of them.

Shutdown: SIGINT or SIGTERM to the supervisor reaches every API process as
SIGTERM; each drains its connections (up to --shutdown-timeout), fails what is
left with 503 and lets the engine go; the engine stops when the last one has.
If any process dies on its own, the supervisor stops the rest and exits 1.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import signal
import socket
import sys
from typing import Any

from engine.config import EngineConfig
from server.config import ServerConfig
from server.engine_loop import EngineFactory, build_engine
from server.engine_process import spawn_engine
from server.engine_wire import EngineEndpoint
from server.metrics import Metrics, MetricsShare

logger = logging.getLogger("pagoda.server")


def run_api_servers(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    engine_factory: EngineFactory | None = None,
) -> int:
    """Serve until told to stop; 0 after a requested shutdown, 1 if a process died."""
    count = server_config.api_server_count
    ctx = multiprocessing.get_context("spawn")
    socks = bind_sockets(server_config, count)  # exits at once if the port is taken
    engine, endpoints = spawn_engine(engine_config, engine_factory or build_engine, count)
    share = ctx.RawArray("d", count * Metrics.num_slots())
    servers = []
    for i, endpoint in enumerate(endpoints):
        process = ctx.Process(
            target=_api_server_main,
            args=(engine_config, server_config, endpoint, MetricsShare(share, i, count), socks[i]),
            name=f"pagoda-api-{i}",
            daemon=True,
        )
        process.start()
        servers.append(process)
    for sock in socks:
        sock.close()  # the API processes hold their own copies
    for endpoint in endpoints:  # theirs too: EOF must reach the engine when one goes
        endpoint.to_engine.close()
        endpoint.from_engine.close()
    logger.info(
        "%d API processes (pids %s), engine pid %d", count, [p.pid for p in servers], engine.pid
    )
    return _supervise(servers, engine, server_config.shutdown_timeout)


def bind_sockets(server_config: ServerConfig, count: int) -> list[socket.socket]:
    """A listening socket for each API process, all on the one port (SO_REUSEPORT),
    so that the kernel spreads connections over the processes evenly, by address.
    From one shared socket, whichever process is in accept() takes a burst of them,
    and a client that keeps its connections stays with it. Without SO_REUSEPORT
    (not Linux), they share one socket, as uvicorn's own workers do."""
    import uvicorn

    config = uvicorn.Config(
        "server.app:create_app",  # never loaded: only binds
        host=server_config.host,
        port=server_config.port,
        log_level=server_config.log_level,
    )
    if count == 1 or not hasattr(socket, "SO_REUSEPORT"):
        sock = config.bind_socket()
        return [sock] * count
    family = socket.AF_INET6 if ":" in server_config.host else socket.AF_INET
    socks: list[socket.socket] = []
    port = server_config.port
    try:
        for _ in range(count):
            sock = socket.socket(family=family)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((server_config.host, port))
            port = sock.getsockname()[1]  # --port 0: the others join the first one's
            # Listening now: a connection hashed to a process still starting waits in
            # its backlog instead of going to whichever process listens first.
            sock.listen(config.backlog)
            sock.set_inheritable(True)
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", server_config.host, port, exc)
        sys.exit(1)
    logger.info("listening on http://%s:%d (%d sockets)", server_config.host, port, count)
    return socks


def _supervise(servers: list[Any], engine: Any, shutdown_timeout: float) -> int:
    state = {"stopping": False, "failed": False}

    def stop_servers() -> None:
        state["stopping"] = True
        for process in servers:
            if process.is_alive():
                process.terminate()  # SIGTERM: uvicorn drains, then the lifespan lets go

    def on_signal(signum: int, _frame: Any) -> None:
        if not state["stopping"]:
            logger.info("%s: shutting down", signal.Signals(signum).name)
        stop_servers()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    while any(p.is_alive() for p in servers):
        alive = [p.sentinel for p in [*servers, engine] if p.is_alive()]
        multiprocessing.connection.wait(alive, timeout=1.0)
        if state["stopping"]:
            continue
        gone = [p for p in [*servers, engine] if not p.is_alive()]
        if gone:
            for process in gone:
                logger.error("%s exited unexpectedly (code %s)", process.name, process.exitcode)
            state["failed"] = True
            stop_servers()
    # The engine stops once every API process has let it go (or died, closing its pipes).
    engine.join(shutdown_timeout + 10)
    if engine.is_alive():
        logger.warning("the engine process did not stop; killing it")
        engine.kill()
        engine.join()
    return 1 if state["failed"] else 0


def _api_server_main(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    endpoint: EngineEndpoint,
    share: MetricsShare,
    sock: socket.socket,
) -> None:
    from server.app import create_app
    from server.http_server import serve_app

    logging.basicConfig(
        level=server_config.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s (api {share.index}): %(message)s",
    )
    app = create_app(engine_config, server_config, engine_endpoint=endpoint, metrics_share=share)
    sys.exit(0 if serve_app(app, server_config, [sock]) else 1)  # host and port unused: sock
