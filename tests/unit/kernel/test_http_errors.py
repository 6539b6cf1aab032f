"""kernel.http_errors: Litestar's own exceptions become our error classes, and the raw ASGI answer
is the same as the handler's."""

import msgspec
import pytest
from litestar.exceptions import (
    HTTPException,
    MethodNotAllowedException,
    NotAuthorizedException,
    NotFoundException,
    PermissionDeniedException,
    TooManyRequestsException,
    ValidationException,
)

from kernel.errors import Unauthorized, Unavailable
from kernel.http_errors import from_http_exception, problem_answer, problem_response


@pytest.mark.parametrize(("exc", "status", "code"), [
    (NotFoundException(), 404, "not-found"),
    (MethodNotAllowedException(headers={"allow": "POST"}), 405, "method-not-allowed"),
    (HTTPException(status_code=413), 413, "payload-too-large"),
    (NotAuthorizedException("no"), 401, "unauthorized"),
    (PermissionDeniedException("no"), 403, "forbidden"),
    (TooManyRequestsException("slow"), 429, "too-many-requests"),
    (HTTPException(status_code=400, detail="bad"), 400, "bad-request"),
    (HTTPException(status_code=408, detail="slow head"), 408, "bad-request"),
    (HTTPException(status_code=503, detail="down"), 503, "unavailable"),
    (HTTPException(status_code=500, detail="boom"), 500, "internal"),
])
def test_litestar_exceptions_map_to_our_classes(exc, status, code):
    err = from_http_exception(exc, path="/p", method="GET", validation_status=422)
    assert (err.status, err.code) == (status, code)
    if status == 500:
        assert err.detail == "internal error"  # never the framework's text


@pytest.mark.parametrize("validation_status", [400, 422])
def test_schema_errors_get_the_services_validation_status_and_every_problem(validation_status):
    exc = ValidationException("bad", extra=[{"message": "Expected `int`", "key": "want"}, {"message": "x"}])
    err = from_http_exception(exc, path="/p", method="POST", validation_status=validation_status)
    assert err.status == validation_status and err.code == "validation-failed"
    assert err.errors == ["want: Expected `int`", "x"]


def test_405_keeps_the_allow_list_and_names_the_method():
    err = from_http_exception(MethodNotAllowedException(headers={"allow": "POST, OPTIONS"}), path="/v1/admit",
                              method="GET", validation_status=422)
    status, headers, body = problem_answer(err, "/v1/admit")
    assert status == 405 and headers["allow"] == "POST, OPTIONS" and "GET" in msgspec.json.decode(body)["detail"]


@pytest.mark.parametrize("exc", [Unauthorized("who"), Unavailable("later", extra={"retryAfterMs": 4_200})])
def test_the_raw_answer_is_the_handlers_answer(exc):
    status, headers, body = problem_answer(exc, "/v1/x")
    resp = problem_response(exc, "/v1/x")
    assert status == resp.status_code and headers.pop("content-type") == resp.media_type
    assert headers == {k.lower(): v for k, v in resp.headers.items()}
    assert msgspec.json.decode(body) == resp.content
