"""Request fields that constrain the output → one GrammarSpec (engine/structured/).

OpenAI's `response_format`, vLLM's `structured_outputs` object and its legacy
`guided_*` aliases, and the constraint a tool choice implies (server/tools.py)
all say the same kind of thing: a request may carry one of them. Each is
validated here, so a bad schema, regex or grammar is a 400 naming its field
before the request is queued.
"""

from __future__ import annotations

import functools

from engine.structured.spec import GrammarSpec, build_grammar
from server.errors import APIError
from server.protocol import SamplingRequest


def grammar_of(
    req: SamplingRequest, tool_grammar: tuple[str, GrammarSpec] | None = None
) -> GrammarSpec | None:
    """The request's one constraint, validated; tool_grammar: (its field, spec)."""
    found = _response_format(req) + _structured_outputs(req) + _guided(req)
    if tool_grammar is not None:
        found.append(tool_grammar)
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(param for param, _ in found)
        raise APIError(
            f"Give at most one output constraint per request; this one has {names}.",
            param=found[1][0],
        )
    param, spec = found[0]
    error = _check(spec)
    if error is not None:
        raise APIError(f"{param}: {error}", param=param)
    return spec


@functools.lru_cache(maxsize=1024)
def _check(spec: GrammarSpec) -> str | None:
    """Why spec is invalid, or None; remembered, so a schema sent again costs nothing."""
    try:
        build_grammar(spec)
    except ValueError as exc:
        return str(exc)
    return None


def field_spec(param: str, make, *args) -> tuple[str, GrammarSpec]:
    """(param, make(*args)); a ValueError of make's is a 400 naming param."""
    try:
        return param, make(*args)
    except ValueError as exc:
        raise APIError(f"{param}: {exc}", param=param) from exc


def _response_format(req: SamplingRequest) -> list[tuple[str, GrammarSpec]]:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return []
    if fmt.type == "json_object":
        return [("response_format", GrammarSpec("json_object"))]
    schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
    if schema is None:
        raise APIError(
            "response_format of type json_schema needs json_schema.schema.",
            param="response_format.json_schema",
        )
    return [field_spec("response_format.json_schema", GrammarSpec.json_schema, schema)]


def _structured_outputs(req: SamplingRequest) -> list[tuple[str, GrammarSpec]]:
    so = req.structured_outputs
    if so is None:
        return []
    given = {name.rstrip("_"): v for name, v in so if v is not None and v is not False}
    if len(given) != 1:
        raise APIError(
            "structured_outputs must set exactly one of json, regex, choice, grammar, "
            f"json_object; got {sorted(given) or 'none'}.",
            param="structured_outputs",
        )
    ((name, value),) = given.items()
    return [_make(f"structured_outputs.{name}", name, value)]


def _guided(req: SamplingRequest) -> list[tuple[str, GrammarSpec]]:
    kinds = ("json", "regex", "choice", "grammar")
    given = {kind: getattr(req, f"guided_{kind}") for kind in kinds}
    return [_make(f"guided_{kind}", kind, v) for kind, v in given.items() if v is not None]


def _make(param: str, kind: str, value) -> tuple[str, GrammarSpec]:
    if kind == "json":
        return field_spec(param, GrammarSpec.json_schema, value)
    if kind == "choice":
        return field_spec(param, GrammarSpec.choice, value)
    if kind == "json_object":
        return param, GrammarSpec("json_object")
    if not value:
        raise APIError(f"{param} must not be empty.", param=param)
    return param, GrammarSpec(kind, value)
