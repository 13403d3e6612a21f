"""POST /v1/responses through the OpenAI SDK: output items (reasoning, message, function
calls) whole and streamed as typed events, tool results sent back as input items, a
cut-short answer, and 400s naming the Responses request's own fields."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

# A one-string schema forces this answer on random weights: the JSON string's opening
# quote and the text up to </think> are the reasoning (R1's parser: the template opened
# <think>), the rest the answer.
FORCED = {"type": "string", "enum": ["two and two</think>four"]}
FORMAT = {"format": {"type": "json_schema", "name": "forced", "schema": FORCED}}
REASONING, ANSWER = '"two and two', 'four"'
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER}
NAMED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(server={"reasoning_parser": "deepseek_r1"})


@pytest.fixture(scope="module")
def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def tools_sdk(start_server) -> openai.OpenAI:
    """No reasoning parser: R1's would take a whole forced call for reasoning."""
    live = start_server(server={"enable_auto_tool_choice": True, "tool_call_parser": "hermes"})
    return openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="x", max_retries=0)


def test_reasoning_and_message_items(sdk, model_name):
    r = sdk.responses.create(
        model=model_name,
        input="What is two and two?",
        text=FORMAT,
        max_output_tokens=40,
        store=False,  # as agent clients send them: accepted
        include=["reasoning.encrypted_content"],
    )
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == REASONING
    assert r.output_text == ANSWER  # the SDK's join of the message's output_text parts
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_streamed_events_build_the_same_response(sdk, model_name):
    settings = dict(model=model_name, input="What is two and two?", text=FORMAT, temperature=0)
    whole = sdk.responses.create(**settings, max_output_tokens=40)
    with sdk.responses.stream(**settings, max_output_tokens=40) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = {"reasoning": "", "message": ""}
    for event in events:
        if event.type == "response.reasoning_text.delta":
            deltas["reasoning"] += event.delta
        elif event.type == "response.output_text.delta":
            deltas["message"] += event.delta
    assert deltas == {"reasoning": REASONING, "message": ANSWER}
    assert [item.type for item in final.output] == [item.type for item in whole.output]
    assert final.output[0].content[0].text == REASONING and final.output_text == ANSWER
    assert final.usage.output_tokens == whole.usage.output_tokens  # greedy: the same tokens
    assert final.text.format.schema_ == FORCED  # the request's settings echoed


def test_function_call_and_its_output_sent_back(tools_sdk, model_name):
    sdk = tools_sdk
    first = sdk.responses.create(
        model=model_name,
        input=[{"role": "user", "content": "Weather in Rome?"}],
        tools=[TOOL],
        tool_choice=NAMED,
        max_output_tokens=60,
    )
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    # Streamed, the same call comes as an item with its arguments in deltas.
    with sdk.responses.stream(
        model=model_name,
        input="Weather in Rome?",
        tools=[TOOL],
        tool_choice=NAMED,
        max_output_tokens=60,
    ) as stream:
        events = list(stream)
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == arguments and done.name == "get_weather"
    json.loads(arguments)
    # The call and its result go back as input items; the answer is cut at 5 tokens.
    second = sdk.responses.create(
        model=model_name,
        instructions="Answer briefly.",
        input=[
            {"role": "user", "content": "Weather in Rome?"},
            *[item.model_dump(exclude_none=True) for item in first.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        ],
        max_output_tokens=5,
    )
    assert second.status == "incomplete"
    assert second.incomplete_details.reason == "max_output_tokens"
    assert second.usage.output_tokens == 5
    assert second.usage.input_tokens > first.usage.input_tokens  # the call and result


def test_reasoning_items_in_either_form_go_back(sdk, model_name):
    """A reasoning item's text as parts or as one string (the fuzzer's find: a 500)."""
    for content in ([{"type": "reasoning_text", "text": "I think"}], "I think"):
        r = sdk.responses.create(
            model=model_name,
            input=[
                {"role": "user", "content": "Hi"},
                {"type": "reasoning", "content": content, "summary": []},
                {"role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
                {"role": "user", "content": "And?"},
            ],
            max_output_tokens=2,
        )
        assert r.status == "incomplete" and r.usage.output_tokens == 2


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call"}]}, "input[1]"),
        ({"input": "hi", "max_output_tokens": 10**6}, "max_output_tokens"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text.format"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        (
            {"input": [{"type": "reasoning", "content": [{"type": "input_image"}]}]},
            "input[0]",
        ),
        ({"input": "hi", "background": True}, "background"),
    ],
)
def test_bad_requests_name_the_field(server, body, param):
    r = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"] or "").startswith(param), r.json()
