"""Property-based requests from /openapi.json (schemathesis): no server errors, and every
response is what the schema documents (status, content type, body). Requests that break
the schema on purpose (negative mode) must be rejected with a 4xx."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = {
    GenerationMode.POSITIVE: [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
    ],
    GenerationMode.NEGATIVE: [
        not_a_server_error,
        negative_data_rejection,
        content_type_conformance,
    ],
}
EXAMPLES = 25  # per operation: a bounded run that still tries every route's edges


def first_failure(operation, mode: GenerationMode, base_url: str) -> str | None:
    """Up to EXAMPLES requests of `mode` to one operation; the first failure, if any."""

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case: schemathesis.Case) -> None:
        case.call_and_validate(base_url=base_url, checks=CHECKS[mode], timeout=60)

    try:
        run()
    except Unsatisfiable:  # negative mode: a route with no input to get wrong
        return None
    except Exception as exc:
        return f"{mode.value} {operation.label}: {exc}"[:2000]
    return None


def test_the_api_is_what_its_schema_says(start_server):
    # A small context keeps generated requests cheap (max_tokens and n are bounded by it).
    live = start_server(engine={"max_model_len": 32}, server={"max_waiting_requests": 64})
    schema = schemathesis.openapi.from_url(f"{live.base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    failures = [
        failure
        for mode in CHECKS
        for operation in operations
        if (failure := first_failure(operation, mode, live.base_url))
    ]
    assert not failures, "\n\n".join(failures)
