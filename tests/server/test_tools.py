"""Tool calling on /v1/chat/completions through the OpenAI SDK: required and named
choices are enforced by a grammar (so even random weights make valid calls), none
makes content, auto finds calls with the server's parser; streamed and not."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 6}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "get_time", "description": "now", "parameters": TIME},
    },
]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tools_server(start_server):
    return start_server(server={"enable_auto_tool_choice": True, "tool_call_parser": "hermes"})


@pytest.fixture(scope="module")
def sdk(tools_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tools_server.base_url}/v1", api_key="x", max_retries=0)


def create(sdk, model_name, **kwargs):
    settings = dict(model=model_name, messages=MESSAGES, tools=TOOLS, max_tokens=120)
    return sdk.chat.completions.create(**(settings | kwargs))


def check_calls(calls) -> None:
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def streamed(sdk, model_name, **kwargs):
    """The SDK's own accumulation of a streamed answer (its final ChatCompletion)."""
    settings = dict(model=model_name, messages=MESSAGES, tools=TOOLS, max_tokens=120)
    with sdk.chat.completions.stream(**(settings | kwargs)) as stream:
        for _ in stream:
            pass
        return stream.get_final_completion()


def test_required_makes_valid_calls(sdk, model_name):
    seen = set()
    for seed in range(6):
        choice = create(sdk, model_name, tool_choice="required", seed=seed).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        assert choice.message.tool_calls
        check_calls(choice.message.tool_calls)
        seen.update(call.function.name for call in choice.message.tool_calls)
    assert seen == set(PARAMETERS)  # the grammar lets the model pick either


def test_required_without_parallel_calls_makes_one(sdk, model_name):
    for seed in range(6):
        choice = create(
            sdk, model_name, tool_choice="required", parallel_tool_calls=False, seed=seed
        ).choices[0]
        assert len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls)


def test_named_function(sdk, model_name):
    choice = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(3):
        result = create(sdk, model_name, tool_choice=choice, seed=seed, n=2)
        for c in result.choices:
            assert c.finish_reason == "tool_calls" and c.message.content is None
            (call,) = c.message.tool_calls
            assert call.function.name == "get_time"
            check_calls([call])


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_streamed_calls_equal_the_whole_answer(sdk, model_name, tool_choice):
    for seed in range(3):
        whole = create(sdk, model_name, tool_choice=tool_choice, seed=seed).choices[0]
        final = streamed(sdk, model_name, tool_choice=tool_choice, seed=seed).choices[0]
        assert final.finish_reason == "tool_calls"
        pairs = [(c.function.name, c.function.arguments) for c in final.message.tool_calls]
        assert pairs == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        check_calls(final.message.tool_calls)


def test_stream_chunks_are_openai_shaped(tools_server, model_name):
    body = {
        "model": model_name,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 120,
        "stream": True,
        "seed": 3,
    }
    deltas, finish = [], None
    with httpx.stream("POST", f"{tools_server.base_url}/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                deltas += choice["delta"].get("tool_calls", [])
                finish = choice["finish_reason"] or finish
    assert finish == "tool_calls"
    first = deltas[0]
    assert first["index"] == 0 and first["id"].startswith("call_")
    assert first["type"] == "function" and first["function"]["name"] in PARAMETERS
    assert len(deltas) > 2  # the arguments come in fragments
    assert all(set(d) == {"index", "function"} for d in deltas if "id" not in d)


def test_none_makes_content(sdk, model_name):
    choice = create(sdk, model_name, tool_choice="none", max_tokens=8).choices[0]
    assert not choice.message.tool_calls and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")


def test_auto_finds_calls_with_the_parser(sdk, model_name):
    # A random model never writes a call by itself; a choice constraint makes it write one,
    # and tool_choice auto must find it in the text.
    kwargs = dict(tool_choice="auto", extra_body={"structured_outputs": {"choice": [HERMES_CALL]}})
    for answer in (create(sdk, model_name, **kwargs), streamed(sdk, model_name, **kwargs)):
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "c"}
    plain = create(sdk, model_name, tool_choice="auto", max_tokens=6, seed=1).choices[0]
    assert isinstance(plain.message.content, str) and not plain.message.tool_calls


def test_a_tools_round_trip_history_is_accepted(sdk, model_name):
    first = create(sdk, model_name, tool_choice="required", seed=0).choices[0].message
    messages = [
        *MESSAGES,
        first.model_dump(exclude_none=True),
        *[
            {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}
            for call in first.tool_calls
        ],
    ]
    answer = create(sdk, model_name, messages=messages, tool_choice="none", max_tokens=4)
    assert answer.choices[0].message.content is not None


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "nonsense"}},
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tools"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{oops"},
                            }
                        ],
                    }
                ]
            },
            "messages",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
    ],
)
def test_bad_tool_requests_are_400s(tools_server, model_name, body, param):
    r = httpx.post(
        f"{tools_server.base_url}/v1/chat/completions",
        json={"model": model_name, "messages": MESSAGES} | body,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_auto_needs_the_server_flag(client):
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_the_sdk_message_object_goes_back_into_the_history(sdk, model_name):
    first = create(sdk, model_name, tool_choice="required", seed=1).choices[0].message
    call = first.tool_calls[0]
    messages = [
        *MESSAGES,
        first,  # the SDK's own object, as the docs' round trip passes it
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'},
    ]
    answer = create(sdk, model_name, messages=messages, tool_choice="none", max_tokens=4)
    assert answer.choices[0].message.content is not None
