"""Every kernels/ module with jit functions is reloaded for the interpreter (conftest)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.kernels.jit_modules import JIT_MODULES


def test_every_module_with_jit_functions_is_reloaded():
    # One left out keeps functions decorated for CUDA, which the interpreter cannot call
    # from its kernels: every test reaching them fails on a CPU-only machine, alone or
    # only after another test imported the module first.
    kernels = Path(__file__).resolve().parents[2] / "kernels"
    with_jit = {
        f"kernels.{path.stem}" for path in kernels.glob("*.py") if "@triton.jit" in path.read_text()
    }
    assert with_jit <= set(JIT_MODULES), sorted(with_jit - set(JIT_MODULES))


def test_modules_reload_after_those_they_import_jit_functions_from():
    # A module reloaded before one it imports from keeps that one's CUDA-decorated
    # functions (`from kernels.x import f` binds f at import time).
    kernels = Path(__file__).resolve().parents[2] / "kernels"
    order = {name: i for i, name in enumerate(JIT_MODULES)}
    for name in JIT_MODULES:
        if not name.startswith("kernels."):
            continue
        source = (kernels / f"{name.removeprefix('kernels.')}.py").read_text()
        for used in re.findall(r"^from (kernels\.\w+) import", source, re.MULTILINE):
            if used in order:
                assert order[used] < order[name], f"{name} is reloaded before {used}"
