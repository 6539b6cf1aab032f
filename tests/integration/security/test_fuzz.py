"""Hostile input: both services' OpenAPI schemas fuzzed with schemathesis against real servers
(the package's service processes, conftest.py: real Redis, real etcd, authentication on). Positive and negative
(schema-violating) cases for every operation; every answer must be a non-5xx whose body matches the schema
(problem+json for errors).

Two bounded profiles, the same strategies and checks (every operation, both modes, derandomized
generation), of two sizes:

* ``make test``: at least 400 requests per service; every operation with inputs at least 5 cases
  in each mode (a case per operation without inputs);
* ``make fuzz`` (``FUZZ_PROFILE=full``): at least 2,000 requests per service.

Generating the cases (hypothesis drawing bodies from the schemas) is ~90 % of the time, the
requests themselves ~10 %: the profile's size is what costs."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

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

CHECKS = [not_a_server_error, response_schema_conformance, content_type_conformance]


@dataclass(frozen=True)
class Profile:
    min_requests: int  # per service
    min_per_case: int  # per operation and generation mode (a mode that cannot apply is exempt)
    per_operation: dict[str, int]  # hypothesis max_examples per operation and mode, per service


PROFILES = {
    "ci": Profile(min_requests=400, min_per_case=5, per_operation={"agent": 60, "allocator": 50}),
    "full": Profile(min_requests=2_000, min_per_case=5, per_operation={"agent": 350, "allocator": 290}),
}


def profile() -> Profile:
    name = os.environ.get("FUZZ_PROFILE", "ci")
    assert name in PROFILES, f"FUZZ_PROFILE={name!r}: expected one of {sorted(PROFILES)}"
    return PROFILES[name]


@dataclass
class Outcome:
    statuses: Counter  # HTTP status -> count
    per_case: Counter  # (operation, mode) -> requests sent
    unsatisfiable: list[str]  # operations whose schema cannot be violated (no inputs)


def fuzz(base: str, per_operation: int) -> Outcome:
    """Every operation, positive then negative cases."""
    schema = schemathesis.openapi.from_url(base + "/schema/openapi.json")
    out = Outcome(Counter(), Counter(), [])
    headers = {"Authorization": f"Bearer {TOKEN}"}
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            out.per_case[(op.label, mode.value)] += 0
            try:
                _cases(op, mode, base, headers, per_operation, out)()
            except Unsatisfiable:  # no way to violate the schema of an operation without inputs
                assert mode is GenerationMode.NEGATIVE
                out.unsatisfiable.append(op.label)
    return out


def _cases(op, mode: GenerationMode, base: str, headers: dict[str, str], per_operation: int, out: Outcome):
    """The hypothesis test of one operation in one mode: each case sent, counted and checked."""
    key = (op.label, mode.value)

    @given(case=op.as_strategy(generation_mode=mode))
    @settings(max_examples=per_operation, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    def run(case) -> None:
        response = case.call(base_url=base, headers=headers)
        out.statuses[response.status_code] += 1
        out.per_case[key] += 1
        case.validate_response(response, checks=CHECKS, headers=headers)

    return run


def check(outcome: Outcome, prof: Profile) -> None:
    statuses = outcome.statuses
    assert sum(statuses.values()) >= prof.min_requests, statuses
    assert not any(s >= 500 for s in statuses), statuses
    assert statuses[200] > 0 and (statuses[400] + statuses[422]) > 0
    # every operation was sent cases in every mode that applies; those with inputs (their schema can
    # be violated) at least min_per_case in each mode
    negative = GenerationMode.NEGATIVE.value
    with_inputs = {op for op, mode in outcome.per_case if mode == negative and op not in outcome.unsatisfiable}
    thin = {k: n for k, n in outcome.per_case.items()
            if not (k[1] == negative and k[0] in outcome.unsatisfiable)
            and n < (prof.min_per_case if k[0] in with_inputs else 1)}
    assert not thin, f"operations and modes sent too few cases: {thin}"


@pytest.mark.timeout(900)  # the full profile (~2,000 generated requests) takes minutes on a loaded machine
def test_agent_schema_fuzz(agent_service):
    prof = profile()
    check(fuzz(agent_service.base, prof.per_operation["agent"]), prof)


@pytest.mark.timeout(900)
def test_allocator_schema_fuzz(allocator_service):
    prof = profile()
    check(fuzz(allocator_service.base, prof.per_operation["allocator"]), prof)
