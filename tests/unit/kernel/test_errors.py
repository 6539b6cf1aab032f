"""kernel.errors: the problem mapping, the retriable flags and the headers every error answer carries."""

import pytest

from kernel.errors import (
    AmbiguousOutcome,
    BadRequest,
    Forbidden,
    MethodNotAllowed,
    NotLeader,
    PolicyError,
    StoreUnavailable,
    TooManyRequests,
    Unauthorized,
    Unavailable,
    ValidationFailed,
    is_retriable,
    problem_headers,
    to_problem,
)


def test_problem_mapping_and_retriable_flags():
    status, body = to_problem(ValidationFailed("bad tenant", errors=["tenantId"]), instance="/v1/admit")
    assert status == 422 and body["status"] == 422 and body["errors"] == ["tenantId"]
    assert body["type"].endswith("/validation-failed") and body["instance"] == "/v1/admit"
    assert body["retriable"] is False
    status, body = to_problem(NotLeader("follower", extra={"leader": "http://x"}))
    assert status == 503 and body["leader"] == "http://x" and body["retriable"] is True
    assert is_retriable(StoreUnavailable()) and is_retriable(AmbiguousOutcome())
    assert not is_retriable(PolicyError()) and not is_retriable(ValueError())


@pytest.mark.parametrize(("exc", "headers"), [
    (BadRequest("x"), {}),
    (Forbidden("x"), {}),
    (Unauthorized("x"), {"WWW-Authenticate": 'Bearer realm="leasehold"'}),
    (MethodNotAllowed("x", allow="POST, OPTIONS"), {"Allow": "POST, OPTIONS"}),
    (Unavailable("x"), {"Retry-After": "1"}),
    (NotLeader("x", extra={"leader": "http://x"}), {"Retry-After": "1"}),
    (TooManyRequests("x", extra={"retryAfterMs": 2_001}), {"Retry-After": "3"}),
    (TooManyRequests("x", extra={"retryAfterMs": 10}), {"Retry-After": "1"}),
    (Unavailable("x", extra={"retryAfterMs": "soon"}), {"Retry-After": "1"}),  # not a number: the default
    (BadRequest("x", retriable=True), {"Retry-After": "1"}),
])
def test_problem_headers(exc, headers):
    assert problem_headers(exc) == headers
