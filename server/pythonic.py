"""Llama 3.2/4's pythonic tool calls (`--tool-call-parser pythonic`): the whole output a
Python list of calls with keyword arguments of literal values, [f(a=1, b="x"), g()],
after an optional <|python_start|>. A call is reported whole once it closes, its
arguments as json.dumps makes them (as vLLM's parser does); an output that is not such a
list is content. What follows the list's last call is dropped."""

from __future__ import annotations

import ast
import json
import re

from server.json_scan import skip_ws
from server.tool_parsers import DraftCall, Extracted, ToolParser


class PythonicParser(ToolParser):
    START = "<|python_start|>"  # Llama 4's, where its special tokens are decoded
    NAME = re.compile(r"[A-Za-z_]\w*")

    def extract(self, text: str, final: bool) -> Extracted:
        i = skip_ws(text, 0)
        if text.startswith(self.START, i):
            i = skip_ws(text, i + len(self.START))
        if i >= len(text) or (not final and self.START.startswith(text[i:])):
            return Extracted(text if final else "")
        if text[i] != "[":
            return Extracted(text, tail="content")  # no list of calls: content, whatever comes
        calls, j, n = [], skip_ws(text, i + 1), len(text)
        while True:  # each call, until one is unfinished (undecided) or not a call
            name = self.NAME.match(text, j)
            k = n if name is None else skip_ws(text, name.end())
            end = _python_call_end(text, k) if k < n and text[k] == "(" else None
            if end is None:
                if (name is None and j < n) or (k < n and text[k] != "("):
                    break  # not a call
                return Extracted(text if final and not calls else "", calls)  # unfinished
            arguments = _keyword_json(text[name.start() : end])
            if arguments is None:
                break
            calls.append(DraftCall(name.group(), arguments))
            j = skip_ws(text, end)
            if not text.startswith(",", j):
                break  # the list ends (what follows it is dropped)
            j = skip_ws(text, j + 1)
        return Extracted("", calls) if calls else Extracted(text, tail="content")


def _python_call_end(text: str, i: int) -> int | None:
    """Just past the ")" closing the "(" at text[i], over Python strings and brackets;
    None if the text ends first."""
    depth, j, n = 0, i, len(text)
    while j < n:
        c = text[j]
        if c in "\"'":
            j += 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            if j >= n:
                return None
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


def _keyword_json(source: str) -> str | None:
    """A call's keyword arguments as a JSON object (None: not a call of literals)."""
    try:
        call = ast.parse(source, mode="eval").body
        if not isinstance(call, ast.Call) or call.args:
            return None
        values = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
        if None in values:  # **kwargs
            return None
        return json.dumps(values, ensure_ascii=False, allow_nan=False)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None
