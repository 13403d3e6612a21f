"""The API server's parsing of a streamed chat answer: reasoning and tool-call streams fed
one token's text at a time, CPU only.

    python -m benchmarks.stream_parse --out benchmarks/results/stream-parse-cpu.json

Each case streams an answer of N tokens (a short word each, no "<" in them) through
`ReasoningStream` (R1's and Qwen3's <think>, GPT-OSS's harmony analysis channel) or
`ToolStream` (content under hermes and harmony, a call's arguments as harmony, hermes
and llama3_json write them: a JSON string, for the last two, and a Qwen3-Coder
parameter's value), and
reports the whole answer's parsing time and its mean per token. A parser that reads the
whole answer again on every token grows with N; one that does not stays flat.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.provenance import git_commit, write_result
from server.parser_names import PARSERS
from server.reasoning import ReasoningStream
from server.tools import ToolStream

WORDS = ["the", "model", "thinks", "about", "tokens", "and", "streams", ",", "."]
HARMONY_FINAL = "<|end|><|start|>assistant<|channel|>final<|message|>answer<|return|>"
# name -> (a fresh stream's feed, the opening text, the closing text)
CASES: dict[str, tuple[Callable[[], Callable], str, str]] = {
    "reasoning deepseek_r1": (
        lambda: ReasoningStream("deepseek_r1").feed,
        "<think>",
        "</think>answer",
    ),
    "reasoning qwen3": (lambda: ReasoningStream("qwen3").feed, "<think>", "</think>answer"),
    "reasoning openai_gptoss": (
        lambda: ReasoningStream("openai_gptoss").feed,
        "<|channel|>analysis<|message|>",
        HARMONY_FINAL,
    ),
    "tools hermes content": (lambda: ToolStream(PARSERS["hermes"]()).feed, "Sure.", "."),
    "tools openai content": (
        lambda: ToolStream(PARSERS["openai"]()).feed,
        "<|channel|>final<|message|>",
        "<|return|>",
    ),
    "tools openai arguments": (
        lambda: ToolStream(PARSERS["openai"]()).feed,
        '<|channel|>commentary to=functions.f<|message|>{"code": "',
        '"}<|call|>',
    ),
    "tools hermes arguments": (
        lambda: ToolStream(PARSERS["hermes"]()).feed,
        '<tool_call>{"name": "f", "arguments": {"code": "',
        '"}}</tool_call>',
    ),
    "tools qwen3_coder value": (
        lambda: ToolStream(PARSERS["qwen3_coder"]()).feed,
        "<tool_call>\n<function=f>\n<parameter=code>\n",
        "\n</parameter>\n</function>\n</tool_call>",
    ),
    "tools llama3_json arguments": (
        lambda: ToolStream(PARSERS["llama3_json"]()).feed,
        '{"name": "f", "parameters": {"code": "',
        '"}}',
    ),
}


def seconds(case: str, tokens: list[str]) -> float:
    make, opening, closing = CASES[case]
    feed = make()
    start = time.perf_counter()
    feed(opening, False)
    for token in tokens:
        feed(token, False)
    feed(closing, True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--lengths", type=int, nargs="+", default=[2000, 16000])
    args = p.parse_args(argv)
    rng = random.Random(0)
    rows = []
    for n in args.lengths:
        tokens = [" " + rng.choice(WORDS) for _ in range(n)]
        for case in CASES:
            took = min(seconds(case, tokens) for _ in range(3))
            rows.append(
                {"case": case, "tokens": n, "ms": 1e3 * took, "us_per_token": 1e6 * took / n}
            )
            print(f"{case:28s} {n:6d} tokens {1e3 * took:9.1f} ms", flush=True)
    result = {
        "benchmark": "stream_parse",
        "command": "python -m benchmarks.stream_parse " + " ".join(argv or sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "commit": git_commit(),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "rows": rows,
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
