"""A free TCP port for a test's server or process group.

A port bound to 0 and released can be handed out again at once, so two pytest-xdist
workers could both pick it before either binds it. Each worker draws from its own range
below Linux's ephemeral ports (32768 and up, where bind(0) and outgoing connections take
theirs), walking it from a random start, so one worker's calls do not repeat a port
either until the range wraps.
"""

from __future__ import annotations

import itertools
import os
import random
import socket

FIRST = 20000
SPAN = 2000  # ports a worker's range holds; six workers fit below 32768


def _walk() -> itertools.cycle:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    first = FIRST + SPAN * (int(worker or 0) % 6)
    start = random.randrange(SPAN)
    return itertools.cycle([first + (start + i) % SPAN for i in range(SPAN)])


_PORTS = _walk()


def free_port() -> int:
    """The next port of this worker's range that binds now."""
    for _ in range(SPAN):
        port = next(_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {FIRST}-{FIRST + 6 * SPAN}")
