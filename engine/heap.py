"""Keep the garbage collector off the startup heap.

Once torch, transformers, the model and the tokenizer are loaded, a process
tracks on the order of a million objects, all of which live until it exits.
CPython's oldest-generation collection walks every one of them: on the H100
host, under serving load, each such pause took 200-370 ms, in the engine
process (no GPU step is launched meanwhile) and in every API process (none of
its streams moves). Frozen objects are never walked again, so a full
collection costs what the requests in flight have allocated. vLLM freezes its
startup heap the same way. The cost: what is frozen is never collected, so a
process that builds engine after engine (a test suite) should `gc.unfreeze()`
between them, as tests/conftest.py does.

Until then, the server does not collect at all (pause_collection): while
startup builds that heap, each oldest-generation collection walks all of it so
far, and the imports alone trigger several.
"""

from __future__ import annotations

import gc

_paused = False  # collection was turned off by pause_collection, not by someone else


def pause_collection() -> None:
    """No collections until freeze_startup_heap (which turns them back on)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def freeze_startup_heap() -> None:
    """Collect what startup left behind, then exempt every survivor from collection."""
    global _paused
    gc.collect()
    gc.freeze()
    if _paused:
        gc.enable()
        _paused = False
