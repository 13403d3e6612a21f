"""Property-based requests from /openapi.json (schemathesis): no server errors, and every
response is what the schema documents (status, content type, body)."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
EXAMPLES = 25  # per operation: a bounded run that still tries every route's edges


def test_the_api_is_what_its_schema_says(start_server):
    # A small context keeps generated requests cheap (max_tokens and n are bounded by it).
    live = start_server(engine={"max_model_len": 32}, server={"max_waiting_requests": 64})
    schema = schemathesis.openapi.from_url(f"{live.base_url}/openapi.json")
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def run(case: schemathesis.Case) -> None:
            case.call_and_validate(base_url=live.base_url, checks=CHECKS, timeout=60)

        try:
            run()
        except Exception as exc:  # collect every operation's first failure
            failures.append(f"{operation.label}: {exc}"[:2000])
    assert not failures, "\n\n".join(failures)
