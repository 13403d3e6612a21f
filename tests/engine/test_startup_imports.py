"""What building an engine imports: not torch's compiler stack, not transformers' models.

Each of these costs startup time and is never used: torch._dynamo (and sympy
under it) comes in through torch._refs when a meta tensor is initialised or
copied with empty_like; transformers' modeling code through its auto classes.
A fresh interpreter, since this process has imported everything already.

transformers' Llama config module itself imports torch.distributed.tensor and
sympy (through transformers.activations), so those are checked on GPT-2 only."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

NEVER = ("torch._dynamo", "transformers.modeling_utils", "transformers.models.llama.modeling")
NOT_FROM_OUR_CODE = ("sympy", "torch.distributed.tensor", "transformers.models.gpt2.modeling")

BUILD = """
import json, sys
from engine.config import EngineConfig
from server.engine_loop import build_engine  # what the engine thread or process calls
engine = build_engine(EngineConfig(model=sys.argv[1], device="cpu", num_kv_blocks=16))
print(json.dumps(sorted(m for m in sys.modules if m.startswith(tuple(sys.argv[2:])))))
"""


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_building_an_engine_imports_no_compiler_and_no_transformers_models(kind, tiny_family_dir):
    never = NEVER + (NOT_FROM_OUR_CODE if kind == "gpt2" else ())
    out = subprocess.run(
        [sys.executable, "-c", BUILD, tiny_family_dir(kind), *never],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
