"""Structured outputs over HTTP: response_format, structured_outputs and guided_*, on the
random-weight tiny GPT-2 (any valid output can only come from the constraint)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from pydantic import BaseModel, Field

CHAT = {"messages": [{"role": "user", "content": "Hi"}]}
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "rainy": {"type": "boolean"},
        "days": {"type": "array", "items": {"enum": ["mon", "tue"]}, "maxItems": 2},
    },
    "required": ["city", "rainy", "days"],
    "additionalProperties": False,
}


class Forecast(BaseModel):
    city: str = Field(max_length=8)
    rainy: bool
    level: int = Field(ge=0, le=9)


def test_sdk_parse_with_a_pydantic_model(oai, model_name):
    completion = oai.chat.completions.parse(
        model=model_name,
        messages=[{"role": "user", "content": "Weather?"}],
        response_format=Forecast,
        max_completion_tokens=100,
        seed=1,
        n=3,
    )
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Forecast)


def test_json_schema_and_json_object_on_chat(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
    body = CHAT | {"response_format": fmt, "max_tokens": 100, "n": 4, "seed": 0}
    for choice in client.post("/v1/chat/completions", json=body).json()["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    body = CHAT | {"response_format": {"type": "json_object"}, "max_tokens": 200, "seed": 2}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:  # a random model may run out of tokens inside a string: still the object's start
        assert choice["message"]["content"].startswith("{")


def test_streamed_json_schema_concatenates_to_valid_json(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
    body = CHAT | {"response_format": fmt, "max_tokens": 100, "stream": True, "seed": 4}
    text, finish = "", None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["delta"].get("content", "")
                finish = choice["finish_reason"] or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize(
    "field, value, check",
    [
        ("structured_outputs", {"regex": r"[a-z]{3}-[0-9]{2}"}, r"[a-z]{3}-[0-9]{2}"),
        ("structured_outputs", {"choice": ["alpha", "beta"]}, r"alpha|beta"),
        ("structured_outputs", {"grammar": 'root ::= "x" [0-9]{2}'}, r"x[0-9]{2}"),
        ("structured_outputs", {"json": SCHEMA}, None),
        ("structured_outputs", {"json_object": True}, None),
        ("guided_regex", r"[A-Z][a-z]{2}", r"[A-Z][a-z]{2}"),
        ("guided_choice", ["up", "down"], r"up|down"),
        ("guided_grammar", 'root ::= "a" | "bb"', r"a|bb"),
        ("guided_json", json.dumps(SCHEMA), None),
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
            None,
        ),
    ],
)
def test_completions_constraints(client, field, value, check):
    body = {"prompt": "Hello", field: value, "max_tokens": 200, "n": 3, "seed": 5}
    choices = client.post("/v1/completions", json=body).json()["choices"]
    assert len(choices) == 3
    for choice in choices:
        if check is not None:
            assert choice["finish_reason"] == "stop"
            assert re.fullmatch(check, choice["text"]), choice["text"]
        elif choice["finish_reason"] == "stop":
            obj = json.loads(choice["text"])
            if "json_object" not in json.dumps(value):
                jsonschema.validate(obj, SCHEMA)


BAD = [
    # (body fields, param)
    ({"guided_json": {"type": "nonsense"}}, "guided_json"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"properties": 3}}}, "structured_outputs.json"),
    ({"structured_outputs": {"nope": 1}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    (
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "structured_outputs.regex",
    ),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            }
        },
        "response_format.json_schema",
    ),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"some_unknown_field": 1}, "some_unknown_field"),
    ({"min_tokens": 2, "guided_choice": ["a"]}, "min_tokens"),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("fields, param", BAD)
def test_bad_constraints_are_400s_naming_the_field(client, path, fields, param):
    base = {"prompt": "x"} if path == "/v1/completions" else CHAT
    r = client.post(path, json=base | fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def test_hints_openai_documents_are_accepted(client):
    hints = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"}
    r = client.post("/v1/chat/completions", json=CHAT | hints | {"max_tokens": 2})
    assert r.status_code == 200, r.text


def test_text_response_format_constrains_nothing(client):
    body = CHAT | {"response_format": {"type": "text"}, "max_tokens": 5, "ignore_eos": True}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "length"
