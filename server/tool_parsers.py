"""Tool calls in generated text: `extract(text, final)` → content and calls so far.

Each parser reads the whole text generated so far and says which part is plain
content and which calls it holds (a name, and the raw JSON text of the
arguments as far as it has come). On a growing text the answers only grow:
content and each call's arguments extend what an earlier, shorter text gave, so
a stream can send the difference (server/tools.py) and the pieces concatenate
to what the whole text gives. The arguments are the model's own JSON text,
cut out of the call object, never re-serialized.

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call> ...
                 (Qwen2.5/Qwen3, Hermes); content is the text before the first call
    llama3_json  {"name": ..., "parameters": {...}}; {...}  (Llama 3.1+), the whole
                 output, after an optional <|python_tag|>
    required     [{"name": ..., "parameters": {...}}, ...]: tool_choice "required",
                 written under a grammar (server/tools.py)
    named        the arguments object of one known function (a named tool_choice)
    openai       GPT-OSS's harmony messages to functions.NAME (server/harmony.py)
    mistral      [TOOL_CALLS]NAME[ARGS]{...} per call (Mistral's v11+ tokenizers: Mistral
                 Small 3.2, Devstral, Magistral) or [TOOL_CALLS][{"name", "arguments"}, ...]
                 (earlier ones); the markers are special tokens, decoded for this parser
    glm45        <tool_call>NAME <arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>
                 (GLM-4.5/4.6/4.7)
    qwen3_coder  <tool_call><function=NAME><parameter=K>V</parameter>...</function></tool_call>
                 (Qwen3-Coder)
    minimax_m2   <minimax:tool_call><invoke name="NAME"><parameter name="K">V</parameter>
                 </invoke>...</minimax:tool_call> (MiniMax-M2). These three write no
                 JSON: their pairs become an object, each pair once its value closes,
                 typed by the function's schema (server/pair_parsers.py)
    granite      [{"name": ..., "arguments": {...}}, ...]  (Granite 3.x), the whole output,
                 after an optional <|tool_call|> or <tool_call>
    pythonic     [f(a=1, b="x"), g()]  (Llama 3.2/4), the whole output: Python calls with
                 keyword arguments of literal values, each call whole once it closes, its
                 arguments as json.dumps makes them (as vLLM's)
    deepseek_v3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
                 ```json {...} ```<｜tool▁call▁end｜>... (DeepSeek-V3, R1-0528)
    deepseek_v31 <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...
                 (DeepSeek-V3.1); the markers of both are special tokens, decoded for them

server/parser_names.py maps --tool-call-parser's names (vLLM's) to these.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from server.json_scan import scan_call, skip_ws, value_end, value_scan


@dataclass
class DraftCall:
    name: str
    arguments: str  # raw JSON text so far


@dataclass
class Extracted:
    content: str
    calls: list[DraftCall] = field(default_factory=list)
    # What text appended to this one extends when it holds no ToolParser.MARK: "content",
    # "call" (the last call's arguments), "string" (the same, the text ending inside a
    # JSON string of them: when the piece holds no '"' or backslash either), "held"
    # (nothing sent: the pair parsers' open value, sent when a tag closes it), or None
    # (not known, or a tag may be under way at the end).
    tail: str | None = None


class ToolParser:
    MARK = "<"  # the character every tag of the parser starts with

    def extract(self, text: str, final: bool) -> Extracted:
        """Content and calls in text; final: no more text comes (an unfinished tag or a
        text with no call at all is content then)."""
        raise NotImplementedError


class HermesParser(ToolParser):
    OPEN = "<tool_call>"

    def extract(self, text: str, final: bool) -> Extracted:
        start = text.find(self.OPEN)
        if start < 0:
            return before_any_call(text, self.OPEN, final)
        calls: list[DraftCall] = []
        pos, tail = start, None
        while pos >= 0:
            i = skip_ws(text, pos + len(self.OPEN))
            if i >= len(text) or text[i] != "{":
                break
            scan = scan_call(text, i, ("arguments", "parameters"))
            if scan.name is not None:
                calls.append(DraftCall(scan.name, scan.arguments))
                tail = "string" if scan.in_string else None
            if scan.end is None:
                break
            pos = text.find(self.OPEN, scan.end)
        if final and not calls:
            return Extracted(text)
        return Extracted(text[:start], calls, tail)


class Llama3JsonParser(ToolParser):
    PYTHON_TAG = "<|python_tag|>"

    def extract(self, text: str, final: bool) -> Extracted:
        i = skip_ws(text, 0)
        if text.startswith(self.PYTHON_TAG, i):
            i = skip_ws(text, i + len(self.PYTHON_TAG))
        elif not final and self.PYTHON_TAG.startswith(text[i:]):
            return Extracted("")  # the tag may be coming
        if i >= len(text):
            return Extracted(text if final else "")
        if text[i] != "{":
            return Extracted(text)
        calls, tail = _call_sequence(text, i, ";", ("parameters", "arguments"))
        if final and not calls:
            return Extracted(text)
        return Extracted("", calls, tail)


class RequiredParser(ToolParser):
    def extract(self, text: str, final: bool) -> Extracted:
        i = skip_ws(text, 0)
        calls, tail = [], None
        if text.startswith("[", i):
            calls, tail = _call_sequence(text, skip_ws(text, i + 1), ",", ("parameters",))
        if final and not calls:
            return Extracted(text)
        return Extracted("", calls, tail)


class NamedParser(ToolParser):
    def __init__(self, name: str) -> None:
        self.name = name

    def extract(self, text: str, final: bool) -> Extracted:
        arguments = text.lstrip()  # all of it, once it has begun
        return Extracted("", [DraftCall(self.name, arguments)], "call" if arguments else None)


class MistralParser(ToolParser):
    """Mistral's calls after [TOOL_CALLS]: a JSON array of call objects, or a name,
    [ARGS] and the arguments object, per call; content is the text before the first."""

    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
    MARK = "["

    def extract(self, text: str, final: bool) -> Extracted:
        start = text.find(self.TAG)
        if start < 0:
            return before_any_call(text, self.TAG, final)
        i = skip_ws(text, start + len(self.TAG))
        tail = None
        if text.startswith("[", i):
            calls, tail = _call_sequence(text, skip_ws(text, i + 1), ",", ("arguments",))
        else:
            calls = self._named_calls(text, start)
        if final and not calls:
            return Extracted(text)
        return Extracted(text[:start], calls, tail)

    def _named_calls(self, text: str, pos: int) -> list[DraftCall]:
        calls = []
        while pos >= 0:
            name_start = pos + len(self.TAG)
            args = text.find(self.ARGS, name_start)
            if args < 0:
                break  # the name may still be arriving
            name = text[name_start:args].strip()
            i = skip_ws(text, args + len(self.ARGS))
            end = value_end(text, i) if text.startswith("{", i) else None
            calls.append(DraftCall(name, text[i : len(text) if end is None else end]))
            if end is None:
                break
            pos = text.find(self.TAG, end)
        return calls


class GraniteParser(ToolParser):
    TAGS = ("<|tool_call|>", "<tool_call>")  # Granite 3.0's, 3.1+'s

    def extract(self, text: str, final: bool) -> Extracted:
        i = skip_ws(text, 0)
        tag = next((t for t in self.TAGS if text.startswith(t, i)), None)
        if tag is not None:
            i = skip_ws(text, i + len(tag))
        elif not final and any(t.startswith(text[i:]) for t in self.TAGS):
            return Extracted("")  # a tag may be coming
        if i >= len(text):
            return Extracted(text if final else "")
        if text[i] != "[":
            return Extracted(text, tail="content")  # no array of calls: content, whatever comes
        calls, tail = _call_sequence(text, skip_ws(text, i + 1), ",", ("arguments",))
        if final and not calls:
            return Extracted(text)
        return Extracted("", calls, tail)


class DeepSeekParser(ToolParser):
    """DeepSeek's calls after <｜tool▁calls▁begin｜>, each from <｜tool▁call▁begin｜>: V3's
    a type, <｜tool▁sep｜>, the name on its line and the arguments in a ```json fence;
    V3.1's (fenced False) the name, <｜tool▁sep｜> and the arguments. Content is the text
    before the first."""

    CALLS, CALL, SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"
    FENCE = "```json"

    def __init__(self, fenced: bool = True) -> None:
        self.fenced = fenced

    def extract(self, text: str, final: bool) -> Extracted:
        start = text.find(self.CALLS)
        if start < 0:
            return before_any_call(text, self.CALLS, final)
        calls: list[DraftCall] = []
        pos, tail = text.find(self.CALL, start), None
        while pos >= 0:
            sep = text.find(self.SEP, pos)
            if sep < 0:
                break
            if self.fenced:  # the name ends its line; a fence opens the arguments
                line = text.find("\n", sep)
                if line < 0:
                    break
                name, fence = text[sep + len(self.SEP) : line].strip(), text.find(self.FENCE, line)
                i = -1 if fence < 0 else skip_ws(text, fence + len(self.FENCE))
            else:
                name, i = (
                    text[pos + len(self.CALL) : sep].strip(),
                    skip_ws(text, sep + len(self.SEP)),
                )
            if i < 0 or i >= len(text) or text[i] != "{":
                calls.append(DraftCall(name, ""))  # named; its arguments not begun
                break
            end, in_string = value_scan(text, i)
            calls.append(DraftCall(name, text[i : len(text) if end is None else end]))
            if end is None:
                tail = "string" if in_string else None
                break
            pos = text.find(self.CALL, end)
        if final and not calls:
            return Extracted(text)
        return Extracted(text[:start], calls, tail)


def _call_sequence(
    text: str, i: int, separator: str, argument_keys: tuple[str, ...]
) -> tuple[list[DraftCall], str | None]:
    """Call objects from text[i] on (none unless it is a "{"), separated by `separator`;
    and the Extracted.tail the last one leaves."""
    calls, tail = [], None
    while text.startswith("{", i):
        scan = scan_call(text, i, argument_keys)
        tail = None
        if scan.name is not None:
            calls.append(DraftCall(scan.name, scan.arguments))
            tail = "string" if scan.in_string else None
        if scan.end is None:
            break
        i = skip_ws(text, scan.end)
        if text.startswith(separator, i):
            i = skip_ws(text, i + 1)
    return calls, tail


def before_any_call(text: str, tag: str, final: bool) -> Extracted:
    """A text no call tag has opened yet: content, but for an end that may be the tag
    arriving."""
    held = 0 if final else partial_suffix(text, tag)
    return Extracted(text[: len(text) - held], tail=None if held else "content")


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of text that begins tag (held back: it may be one)."""
    return next((k for k in range(len(tag) - 1, 0, -1) if text.endswith(tag[:k])), 0)
