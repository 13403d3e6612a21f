"""Tool-call parsers on whole texts, and streamed in every split: the deltas concatenate
to what the whole text gives."""

from __future__ import annotations

import json

import pytest

from server.pair_parsers import Glm45Parser, MiniMaxM2Parser, Qwen3CoderParser
from server.parser_names import PARSERS
from server.protocol import ChatCompletionRequest, FunctionDefinition
from server.pythonic import PythonicParser
from server.tool_parsers import (
    DeepSeekParser,
    DraftCall,
    GraniteParser,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    NamedParser,
    RequiredParser,
)
from server.tools import ToolStream, plan_tools

HERMES = (
    "Let me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
    "</tool_call>\n"
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "a \\"quoted\\" }{ brace"}}\n'
    "</tool_call>"
)
HERMES_CALLS = [
    DraftCall("get_weather", '{"city": "Paris", "days": [1, 2]}'),
    DraftCall("get_time", '{"zone": "a \\"quoted\\" }{ brace"}'),
]
LLAMA3 = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
    '{"name": "get_time", "parameters": {}}'
)
REQUIRED = '[{"name": "get_weather", "parameters": {"city": "Rome", "n": 3}}, {"name": "f", "parameters": {}}]'
# GLM-4.5's: a name line, then key/value pairs; the second call has none.
GLM = (
    "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n"
    "<arg_key>days</arg_key>\n<arg_value>[1, 2]</arg_value>\n<arg_key>zip</arg_key>\n"
    "<arg_value>184</arg_value>\n</tool_call><tool_call>get_time</tool_call>"
)
# Mistral's, v11+ tokenizers (name, [ARGS], object) and earlier ones (a JSON array).
MISTRAL = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": [1, 2]}[TOOL_CALLS]get_time[ARGS]{}'
MISTRAL_ARRAY = (
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "a1b2c3d4e"}]'
)
# DeepSeek-V3's: a type, the name on its line, the arguments fenced; V3.1's: name, object.
DEEPSEEK_V3 = (
    "Let me see.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    '```json\n{"city": "Paris", "note": "a } and ``` inside"}\n```<｜tool▁call▁end｜>\n'
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜>"
    "<｜tool▁calls▁end｜>"
)
DEEPSEEK_V31 = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    '{"city": "Paris", "days": [1, 2]}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time'
    "<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
)
# Qwen3-Coder's: each value on lines of its own, a code value with newlines inside.
QWEN3_CODER = (
    "Running it.\n<tool_call>\n<function=run>\n<parameter=code>\nx = 1\n\nprint(x)\n"
    "</parameter>\n<parameter=timeout>\n30\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
)
# MiniMax-M2's: one block, an invoke per call, a value with a newline and a "<" inside.
MINIMAX_M2 = (
    'Looking.\n<minimax:tool_call>\n<invoke name="run">\n<parameter name="code">if a < b:\n'
    '    f()</parameter>\n<parameter name="timeout">30</parameter>\n</invoke>\n'
    '<invoke name="get_time">\n</invoke>\n</minimax:tool_call>'
)

# Granite 3.x's: a JSON array of call objects after its tag.
GRANITE = (
    '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Oslo", "days": [1, 2]}}, '
    '{"name": "get_time", "arguments": {}}]'
)
# Llama 3.2's pythonic calls: literals of every kind, a ")" and quotes inside strings.
PYTHONIC = (
    "[get_weather(city='San Francisco', days=[1, 2], opts={'unit': \"c)\"}), "
    'get_time(zone="it\'s", exact=True, skew=-1.5, none=None)]'
)
PYTHONIC_CALLS = [
    DraftCall("get_weather", '{"city": "San Francisco", "days": [1, 2], "opts": {"unit": "c)"}}'),
    DraftCall("get_time", '{"zone": "it\'s", "exact": true, "skew": -1.5, "none": null}'),
]


def test_hermes_whole_text():
    found = HermesParser().extract(HERMES, final=True)
    assert found.content == "Let me check.\n"
    assert found.calls == HERMES_CALLS
    for call in found.calls:
        json.loads(call.arguments)


def test_hermes_without_calls_is_content():
    parser = HermesParser()
    assert parser.extract("just text", True).content == "just text"
    broken = "hi <tool_call>\n{not json}\n</tool_call>"
    assert parser.extract(broken, True).content == broken  # no call could be read: all content
    assert parser.extract(broken, True).calls == []


def test_llama3_json():
    found = Llama3JsonParser().extract(LLAMA3, final=True)
    assert found.content == ""
    assert found.calls == [
        DraftCall("get_weather", '{"city": "Oslo"}'),
        DraftCall("get_time", "{}"),
    ]
    assert Llama3JsonParser().extract("The answer is 4.", True).content == "The answer is 4."


def test_glm45_pairs_typed_by_the_schema():
    # Without schemas a value is JSON where it parses: the zip code becomes a number.
    found = Glm45Parser().extract(GLM, final=True)
    assert found.content == "Checking.\n"
    assert found.calls == [
        DraftCall("get_weather", '{"city": "Rome", "days": [1, 2], "zip": 184}'),
        DraftCall("get_time", "{}"),
    ]
    # With them, a string parameter stays a string; the rest are read as JSON.
    properties = {"city": {"type": "string"}, "days": {"type": "array"}, "zip": {"type": "string"}}
    schema = FunctionDefinition(
        name="get_weather", parameters={"type": "object", "properties": properties}
    )
    typed = Glm45Parser({"get_weather": schema}).extract(GLM, final=True)
    assert json.loads(typed.calls[0].arguments) == {"city": "Rome", "days": [1, 2], "zip": "184"}


def test_mistral_both_layouts():
    found = MistralParser().extract(MISTRAL, final=True)
    assert found.content == "Sure."
    assert found.calls == [
        DraftCall("get_weather", '{"city": "Paris", "days": [1, 2]}'),
        DraftCall("get_time", "{}"),
    ]
    found = MistralParser().extract(MISTRAL_ARRAY, final=True)
    assert (found.content, found.calls) == ("", [DraftCall("get_weather", '{"city": "Oslo"}')])


def test_deepseek_both_formats():
    found = DeepSeekParser().extract(DEEPSEEK_V3, final=True)
    assert found.content == "Let me see."
    assert found.calls == [
        DraftCall("get_weather", '{"city": "Paris", "note": "a } and ``` inside"}'),
        DraftCall("get_time", "{}"),
    ]
    found = PARSERS["deepseek_v31"]().extract(DEEPSEEK_V31, final=True)
    assert (found.content, found.calls) == (
        "",
        [
            DraftCall("get_weather", '{"city": "Paris", "days": [1, 2]}'),
            DraftCall("get_time", "{}"),
        ],
    )
    assert DeepSeekParser().extract("No call.", final=True).content == "No call."


def test_qwen3_coder_values_keep_their_inner_lines():
    found = Qwen3CoderParser().extract(QWEN3_CODER, final=True)
    assert found.content == "Running it.\n"
    assert found.calls == [
        DraftCall("run", '{"code": "x = 1\\n\\nprint(x)", "timeout": 30}'),
        DraftCall("get_time", "{}"),
    ]


def test_glm47_calls_without_a_newline_after_the_name():
    glm47 = PARSERS["glm47"]()  # vLLM's name for GLM-4.7's
    text = "<tool_call>f<arg_key>x</arg_key><arg_value>1</arg_value></tool_call>"
    assert glm47.extract(text, final=True).calls == [DraftCall("f", '{"x": 1}')]


def test_minimax_m2_calls_in_one_block():
    found = MiniMaxM2Parser().extract(MINIMAX_M2, final=True)
    assert found.content == "Looking.\n"
    assert found.calls == [
        DraftCall("run", '{"code": "if a < b:\\n    f()", "timeout": 30}'),
        DraftCall("get_time", "{}"),
    ]
    unclosed = "Hm.<minimax:tool_call>\n"  # a block with no call: the text is the answer
    assert MiniMaxM2Parser().extract(unclosed, final=True).content == unclosed


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("glm45", "<tool_call>f<arg_key>x</arg_key><arg_value>1</arg_value></tool_call>"),
        ("qwen3_coder", "<tool_call><function=f><parameter=x>1</parameter></tool_call>"),
        (
            "minimax_m2",
            '<minimax:tool_call><invoke name="f"><parameter name="x">1</parameter></invoke>',
        ),
    ],
)
def test_plan_tools_hands_the_pair_parsers_the_requests_functions(parser, text):
    x = {"type": "object", "properties": {"x": {"type": "string"}}}
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": x}}],
        }
    )
    found = plan_tools(req, parser).parser().extract(text, True)
    assert found.calls == [DraftCall("f", '{"x": "1"}')]  # a string, as its schema says


def test_granite_and_pythonic_whole_texts():
    assert GraniteParser().extract(GRANITE, True).calls == [
        DraftCall("get_weather", '{"city": "Oslo", "days": [1, 2]}'),
        DraftCall("get_time", "{}"),
    ]
    llama4 = PARSERS["llama4_pythonic"]()  # vLLM's name for Llama 4's
    found = llama4.extract(f"<|python_start|>{PYTHONIC}<|python_end|>", True)
    assert (found.content, found.calls) == ("", PYTHONIC_CALLS)
    # Not a list of calls of literals: the text is the answer.
    for text in ("[1, 2]", "[f(1)]", "[f(a=x)]", "[f(**k)]", "[f(a={1})]", "See [1]."):
        assert PythonicParser().extract(text, True).content == text


def test_required_and_named():
    assert RequiredParser().extract(REQUIRED, True).calls == [
        DraftCall("get_weather", '{"city": "Rome", "n": 3}'),
        DraftCall("f", "{}"),
    ]
    assert NamedParser("f").extract('{"x": 1}', True).calls == [DraftCall("f", '{"x": 1}')]


def stream(parser, text: str, cuts: list[int], parallel: bool = True) -> tuple[str, list, str]:
    """Feed text in pieces cut at `cuts`; (content, calls as OpenAI's SDK accumulates
    them, finish_reason)."""
    s = ToolStream(parser, parallel)
    bounds = [0, *cuts, len(text)]
    content, calls = "", []
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        delta = s.feed(text[a:b], final=k == len(bounds) - 2)
        content += delta.get("content", "")
        for piece in delta.get("tool_calls", []):
            if "id" in piece:  # a call opens with its index, id and name
                assert piece["index"] == len(calls) and piece["type"] == "function"
                calls.append({"id": piece["id"], **piece["function"]})
            else:
                assert set(piece) == {"index", "function"} and set(piece["function"]) == {
                    "arguments"
                }
                calls[piece["index"]]["arguments"] += piece["function"]["arguments"]
    return content, calls, s.finish_reason("stop")


# A string that a piece may end inside: escaped quotes and backslashes, braces and a "<".
ESCAPES = (
    '<tool_call>{"name": "run", "arguments": {"code": "print(\\"a\\\\b\\") # } < x", '
    '"n": [1, {"k": "v\\""}]}}</tool_call>'
)


@pytest.mark.parametrize(
    "parser, text, content, calls",
    [
        (HermesParser, HERMES, "Let me check.\n", HERMES_CALLS),
        (Glm45Parser, GLM, "Checking.\n", None),
        (Qwen3CoderParser, QWEN3_CODER, "Running it.\n", None),
        (MiniMaxM2Parser, MINIMAX_M2, "Looking.\n", None),
        (MistralParser, MISTRAL, "Sure.", None),
        (MistralParser, MISTRAL_ARRAY, "", None),
        (DeepSeekParser, DEEPSEEK_V3, "Let me see.", None),
        (lambda: DeepSeekParser(fenced=False), DEEPSEEK_V31, "", None),
        (Llama3JsonParser, LLAMA3, "", None),
        (RequiredParser, REQUIRED, "", None),
        (lambda: NamedParser("f"), '{"a": [1, {"b": "}"}]}', "", None),
        (HermesParser, ESCAPES, "", None),
        (
            Llama3JsonParser,
            ESCAPES.removeprefix("<tool_call>").removesuffix("</tool_call>"),
            "",
            None,
        ),
        (GraniteParser, GRANITE, "", None),
        (GraniteParser, "[1] is a footnote.", "[1] is a footnote.", []),
        (PythonicParser, PYTHONIC, "", PYTHONIC_CALLS),
        (PythonicParser, "[Note](see f(a=1))", "[Note](see f(a=1))", []),
        (PythonicParser, "No call here.", "No call here.", []),
        (HermesParser, "no calls <tool_ here", "no calls <tool_ here", []),
        (Llama3JsonParser, '{"not": "a call"}', '{"not": "a call"}', []),
    ],
)
def test_stream_split_anywhere_gives_the_whole_texts_calls(parser, text, content, calls):
    whole = parser().extract(text, final=True)
    want_calls = [(c.name, c.arguments) for c in (calls if calls is not None else whole.calls)]
    splits = [[i] for i in range(1, len(text))] + [list(range(1, len(text)))]  # one cut; each char
    for cuts in splits:
        got_content, got_calls, finish = stream(parser(), text, cuts)
        assert got_content == content == (whole.content if whole.calls else whole.content)
        assert [(c["name"], c["arguments"]) for c in got_calls] == want_calls
        assert finish == ("tool_calls" if want_calls else "stop")
        assert len({c["id"] for c in got_calls}) == len(got_calls)


def test_stream_without_parallel_calls_keeps_the_first():
    _, calls, _ = stream(HermesParser(), HERMES, list(range(1, len(HERMES), 7)), parallel=False)
    assert [c["name"] for c in calls] == ["get_weather"]


@pytest.mark.parametrize(
    ("parser", "opening", "field"),
    [
        ("hermes", "Sure.", "content"),
        ("granite", "Sure.", "content"),
        ("pythonic", "Sure.", "content"),
        ("openai", "<|channel|>final<|message|>Sure.", "content"),
        ("openai", '<|channel|>commentary to=functions.f<|message|>{"code": "', "arguments"),
        # Inside a JSON string of the arguments: pieces without '"' or a backslash.
        ("hermes", '<tool_call>{"name": "f", "arguments": {"code": "', "arguments"),
        ("llama3_json", '{"name": "f", "parameters": {"n": 1, "code": "', "arguments"),
        ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"code": "', "arguments"),
        (
            "deepseek_v3",
            '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{"c": "',
            "arguments",
        ),
        (
            "deepseek_v31",
            '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"c": "',
            "arguments",
        ),
        ("deepseek_v3", "Sure.", "content"),
        ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=code>\n", "held"),
        ("glm45", "<tool_call>f\n<arg_key>code</arg_key><arg_value>", "held"),
        ("minimax_m2", "Sure.", "content"),
        (
            "minimax_m2",
            '<minimax:tool_call>\n<invoke name="f">\n<parameter name="code">',
            "held",
        ),
    ],
)
def test_pieces_without_a_tag_are_not_parsed_again(parser, opening, field):
    """A long answer or call streams in linear time: after a parse, pieces without "<"
    extend the content, or the last call's arguments, without a parse of the text."""
    parses = []
    tool_parser = PARSERS[parser]()
    real = tool_parser.extract
    tool_parser.extract = lambda *args: parses.append(1) or real(*args)
    stream = ToolStream(tool_parser)
    stream.feed(opening, False)
    pieces = [f" word{i}" for i in range(100)]
    deltas = [stream.feed(piece, False) for piece in pieces]
    if field == "content":
        assert "".join(d["content"] for d in deltas) == "".join(pieces)
    elif field == "held":  # an open value: sent whole when its closing tag comes
        assert deltas == [{}] * len(pieces)
    else:
        got = [d["tool_calls"][0] for d in deltas]
        assert all(piece["index"] == 0 for piece in got)
        assert "".join(piece["function"]["arguments"] for piece in got) == "".join(pieces)
    assert len(parses) == 1  # the opening's


def test_content_is_held_while_a_tag_may_begin():
    s = ToolStream(HermesParser())
    assert s.feed("Hi <tool", False) == {"content": "Hi "}
    assert s.feed("_call>", False) == {}
    assert s.feed('{"name": "f"', False)["tool_calls"][0]["function"]["name"] == "f"
