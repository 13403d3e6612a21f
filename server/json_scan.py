"""A small JSON scanner for tool calls as they stream in: where a call object, a value
or a string ends in a text that may stop anywhere (None: not there yet), and a call
object's name and raw arguments text so far (server/tool_parsers.py)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_WS = re.compile(r"[ \t\r\n]*")
_SCALAR = re.compile(r"[^,}\] \t\r\n]*")
_STRING = re.compile(r'"(?:[^"\\]|\\[\s\S])*"')  # an escape takes the character after it


@dataclass
class CallScan:
    name: str | None  # None until the name's string is complete
    arguments: str  # the arguments value's text so far
    end: int | None  # just past the object's closing brace; None: not there yet
    in_string: bool = False  # the text ends inside a string of the arguments


def scan_call(text: str, i: int, argument_keys: tuple[str, ...]) -> CallScan:
    """The call object starting at text[i] == "{", as far as text goes."""
    scan = CallScan(None, "", None)
    n = len(text)
    j = i + 1
    while True:
        j = skip_ws(text, j)
        if j >= n:
            return scan
        if text[j] == "}":
            scan.end = j + 1
            return scan
        if text[j] == ",":
            j += 1
            continue
        if text[j] != '"':
            return scan  # not a call object: it never completes
        key_end = string_end(text, j)
        if key_end is None:
            return scan
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= n or text[j] != ":":
            return scan
        j = skip_ws(text, j + 1)
        if j >= n:
            return scan
        end, in_string = value_scan(text, j)
        if key in argument_keys:
            scan.arguments = text[j : n if end is None else end]
            scan.in_string = in_string
        elif key == "name" and end is not None:
            name = json.loads(text[j:end])
            scan.name = name if isinstance(name, str) else None
        if end is None:
            return scan
        j = end


def skip_ws(text: str, i: int) -> int:
    return _WS.match(text, i).end()


def string_end(text: str, i: int) -> int | None:
    """Just past the JSON string starting at text[i] == '"' (None: not closed yet)."""
    match = _STRING.match(text, i)
    return None if match is None else match.end()


def value_end(text: str, i: int) -> int | None:
    """Just past the JSON value starting at text[i]; None if the text ends first."""
    return value_scan(text, i)[0]


def value_scan(text: str, i: int) -> tuple[int | None, bool]:
    """(value_end, whether the text ends inside one of the value's strings)."""
    c, n = text[i], len(text)
    if c == '"':
        end = string_end(text, i)
        return end, end is None
    if c in "{[":
        depth, j = 0, i
        while j < n:
            c = text[j]
            if c == '"':
                end = string_end(text, j)
                if end is None:
                    return None, True
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1, False
            j += 1
        return None, False
    j = _SCALAR.match(text, i).end()  # a number, true, false or null: up to a delimiter
    return (j if j < n else None), False
