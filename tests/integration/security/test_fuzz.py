"""Hostile input: both services' OpenAPI schemas fuzzed with schemathesis against real servers
(the package's service processes, conftest.py: real Redis, real etcd, authentication on). Positive and negative
(schema-violating) cases; every answer must be a non-5xx whose body matches the schema
(problem+json for errors). A bounded profile: >= 2,000 requests per service."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
)

from .conftest import TOKEN

MIN_REQUESTS = 2_000
CHECKS = [not_a_server_error, response_schema_conformance, content_type_conformance]


def fuzz(base: str, per_operation: int) -> Counter:
    """Every operation, positive then negative cases; returns status counts."""
    schema = schemathesis.openapi.from_url(base + "/schema/openapi.json")
    statuses: Counter = Counter()
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=base, timeout=10) as _client:
        for result in schema.get_all_operations():
            op = result.ok()
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                @given(case=op.as_strategy(generation_mode=mode))
                @settings(max_examples=per_operation, deadline=None, database=None, derandomize=True,
                          phases=[Phase.generate], suppress_health_check=list(HealthCheck))
                def run(case) -> None:
                    response = case.call(base_url=base, headers=headers)
                    statuses[response.status_code] += 1
                    case.validate_response(response, checks=CHECKS, headers=headers)
                try:
                    run()
                except Unsatisfiable:  # no way to violate the schema of an operation without inputs
                    assert mode is GenerationMode.NEGATIVE
    return statuses


@pytest.mark.timeout(900)  # ~2,000 generated requests: minutes on a loaded machine
def test_agent_schema_fuzz(agent_service):
    statuses = fuzz(agent_service.base, per_operation=350)
    total = sum(statuses.values())
    assert total >= MIN_REQUESTS, statuses
    assert not any(s >= 500 for s in statuses), statuses
    assert statuses[200] > 0 and (statuses[400] + statuses[422]) > 0


@pytest.mark.timeout(900)
def test_allocator_schema_fuzz(allocator_service):
    statuses = fuzz(allocator_service.base, per_operation=290)
    total = sum(statuses.values())
    assert total >= MIN_REQUESTS, statuses
    assert not any(s >= 500 for s in statuses), statuses
    assert statuses[200] > 0 and (statuses[400] + statuses[422]) > 0
