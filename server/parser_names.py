"""--tool-call-parser's names, vLLM's, and the parser each names."""

from __future__ import annotations

from collections.abc import Callable

from server.harmony import HarmonyToolParser
from server.pair_parsers import Glm45Parser, MiniMaxM2Parser, Qwen3CoderParser
from server.pythonic import PythonicParser
from server.tool_parsers import (
    DeepSeekParser,
    GraniteParser,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ToolParser,
)

PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "openai": HarmonyToolParser,  # GPT-OSS's harmony messages (server/harmony.py)
    "glm45": Glm45Parser,
    "glm47": Glm45Parser,  # vLLM's name for GLM-4.7's: the name ends at its first pair
    "qwen3_coder": Qwen3CoderParser,
    "minimax_m2": MiniMaxM2Parser,
    "mistral": MistralParser,
    "granite": GraniteParser,
    "pythonic": PythonicParser,
    "llama4_pythonic": PythonicParser,  # vLLM's name for Llama 4's
    "deepseek_v3": DeepSeekParser,
    "deepseek_v31": lambda: DeepSeekParser(fenced=False),
}
# The parsers whose markers are special tokens: their answers are decoded with them.
KEEPS_SPECIAL_TOKENS = ("openai", "mistral", "deepseek_v3", "deepseek_v31")
