"""Keep the garbage collector off the startup heap.

Once torch, transformers, the model and the tokenizer are loaded, a process
tracks on the order of a million objects, all of which live until it exits, and
CPython's oldest-generation collection walks every one of them: a pause in which
no GPU step is launched and no stream moves. Frozen objects are never walked
again (vLLM freezes its startup heap the same way); what is frozen is never
collected, so a process that builds engine after engine (a test suite) should
`gc.unfreeze()` between them, as tests/conftest.py does.

Until then, the server does not collect at all (pause_collection): the imports
alone trigger several full collections of the heap built so far.
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
    """Exempt everything alive now from collection. Not collected first: a full
    collection walks the whole startup heap, on the way to ready, to find a few
    hundred small cycles (on the demo model: import and build leftovers, no tensors),
    which frozen cost less than that pause."""
    global _paused
    gc.freeze()
    if _paused:
        gc.enable()
        _paused = False
