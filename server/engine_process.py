"""The engine in a process of its own (`--engine-process`), vLLM's layout.

In one process the event loop and the engine thread take turns holding the
GIL: every SSE chunk the loop writes is time the engine's host work (schedule,
prepare, read, detokenize) does not get, and at large batches the engine alone
needs most of a core. Here the engine runs an EngineLoop in a child process
with its own interpreter; the API server keeps the loop to itself.

The two talk over two pipes of pickled messages:
  API → engine   ("put", [Add | Abort, ...]), ("stop",)
  engine → API   ("ready", EngineInfo, stats), ("failed", message),
                 ("report", batch, step_time, stats, num_added)
A reader thread on each side turns messages into calls. The credit the API
side returns after each delivery is a shared-memory byte, not a message: it
is returned hundreds of times a second, and a pipe write costs a syscall. The child is spawned,
never forked: CUDA cannot be initialised in a forked child.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from server.engine_loop import Abort, Add, EngineLoop, Report

logger = logging.getLogger("pagoda.server")


@dataclass
class EngineInfo:
    """What the API process needs of an engine that lives elsewhere."""

    model_name: str
    model_dir: str
    config: EngineConfig  # as the engine resolved it (max_model_len filled in)
    vocab_size: int
    tokenizer: Any = None  # loaded by the API process from model_dir

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        from engine.engine import check_request

        check_request(prompt_token_ids, params, self.config.max_model_len, self.vocab_size)


class EngineProcess:
    """The API side's handle: start, put, ack, stop, join; reports arrive on a thread."""

    def __init__(
        self,
        config: EngineConfig,
        factory: Callable[[EngineConfig], Any],
        report: Report,
        on_exit: Callable[[], None],
        switch_interval: float,
    ) -> None:
        self._config = config
        self._factory = factory
        self._report = report
        self._on_exit = on_exit  # the child is gone (stopped or died); from the reader
        self._switch_interval = switch_interval
        self._process: Any = None
        self._to_child: Connection | None = None
        self._from_child: Connection | None = None
        self._reader: threading.Thread | None = None
        self._credit: Any = None

    async def start(self) -> EngineInfo:
        """Spawn the child and wait until its engine is built (or raise why not)."""
        ctx = multiprocessing.get_context("spawn")
        from_child, child_out = ctx.Pipe(duplex=False)
        child_in, to_child = ctx.Pipe(duplex=False)
        self._credit = ctx.RawValue("b", 1)
        self._process = ctx.Process(
            target=_child_main,
            args=(
                child_in,
                child_out,
                self._credit,
                self._config,
                self._factory,
                self._switch_interval,
                logger.getEffectiveLevel(),  # a spawned child starts with logging unset
            ),
            name="pagoda-engine",
            daemon=True,
        )
        self._process.start()
        child_in.close()
        child_out.close()
        self._to_child, self._from_child = to_child, from_child
        try:
            kind, *rest = await asyncio.to_thread(from_child.recv)
        except EOFError:
            raise RuntimeError("the engine process exited while starting") from None
        if kind == "failed":
            raise RuntimeError(f"the engine process failed to start: {rest[0]}")
        info, stats = rest
        self._report({}, 0.0, stats, 0)
        self._reader = threading.Thread(target=self._read, name="pagoda-engine-reader", daemon=True)
        self._reader.start()
        return info

    def _read(self) -> None:
        assert self._from_child is not None
        try:
            while True:
                _, batch, step_time, stats, num_added = self._from_child.recv()
                self._report(batch, step_time, stats, num_added)
        except (EOFError, OSError):
            pass
        except Exception:
            logger.exception("reading from the engine process failed")
        self._on_exit()

    @property
    def is_alive(self) -> bool:
        return (
            self._process is not None
            and self._process.is_alive()
            and self._reader is not None
            and self._reader.is_alive()
        )

    def put(self, items: list[Add | Abort]) -> None:
        self._send(("put", items))

    def ack(self) -> None:
        self._credit.value = 1

    def stop(self) -> None:
        self._send(("stop",))

    def _send(self, message: tuple) -> None:
        # The child is gone (or never came up): the reader reports that.
        with contextlib.suppress(OSError, AttributeError):
            self._to_child.send(message)

    def join(self, timeout: float) -> None:
        if self._process is None:
            return
        self._process.join(timeout)
        if self._process.is_alive():
            logger.warning("the engine process did not stop in %.0f s; killing it", timeout)
            self._process.kill()
            self._process.join()


def _child_main(
    from_parent: Connection,
    to_parent: Connection,
    credit: Any,
    config: EngineConfig,
    factory: Callable[[EngineConfig], Any],
    switch_interval: float,
    log_level: int,
) -> None:
    logging.basicConfig(
        level=log_level,
        format="%(asctime)s %(levelname)s %(name)s (engine process): %(message)s",
    )
    sys.setswitchinterval(switch_interval)  # the reader must not wait 5 ms to hand over a put
    # Ctrl-C reaches the whole process group: the API process drains its connections
    # and then stops this one through the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    state: dict[str, Any] = {"stats": None, "ready": False}

    def report(batch: dict, step_time: float, stats: Any, num_added: int) -> None:
        if state["ready"] and (batch or num_added or stats != state["stats"]):
            to_parent.send(("report", batch, step_time, stats, num_added))
        state["stats"] = stats

    loop = EngineLoop(config, factory, report, credit)
    try:
        engine = loop.build()
    except BaseException as exc:
        to_parent.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    info = EngineInfo(engine.model_name, engine.model_dir, engine.config, engine.vocab_size)
    to_parent.send(("ready", info, state["stats"]))
    state["ready"] = True

    def read() -> None:
        try:
            while True:
                kind, *rest = from_parent.recv()
                if kind == "put":
                    loop.put(rest[0])
                elif kind == "stop":
                    break
        except (EOFError, OSError):
            pass  # the API process is gone: stop too
        loop.stop()

    threading.Thread(target=read, name="pagoda-engine-inbox", daemon=True).start()
    loop.serve()
