"""The fast path's one pass over the request headers answers what kernel.jsonbody's rule and
the announced Content-Length answer: the request is served only with exactly one JSON
Content-Type, and the first Content-Length is the one compared with the limit."""

import pytest

from kernel.errors import LeaseholdError
from kernel.jsonbody import content_type_of, is_json_media_type
from region_agent.service.fastpath import _announced_json, _json_within

LIMIT = 65536


def _reference(headers: list[tuple[bytes, bytes]]) -> bool:
    """Served by the fast path (before reading the body): the two checks it had before."""
    try:
        plain = is_json_media_type(content_type_of(headers))
    except LeaseholdError:
        plain = False
    announced = 0
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                announced = int(value)
            except ValueError:
                announced = 0
            break
    return plain and announced <= LIMIT


CT = b"content-type"
CL = b"content-length"
CASES = [
    [(b"host", b"x"), (CT, b"application/json"), (CL, b"131")],
    [(CT, b"application/json; charset=utf-8"), (CL, b"10")],
    [(CT, b"Application/JSON ; charset=\"UTF8\"")],
    [(CT, b"application/json; charset=latin-1"), (CL, b"10")],
    [(CT, b"text/plain"), (CL, b"10")],
    [(CT, b"application/json"), (CT, b"application/json")],
    [(b"Content-Type", b"application/json"), (b"CONTENT-LENGTH", b"12")],
    [(CL, b"10")],
    [],
    [(CT, b"application/json"), (CL, b"65537")],
    [(CT, b"application/json"), (CL, b"65536")],
    [(CT, b"application/json"), (CL, b"12"), (CL, b"99999999")],
    [(CT, b"application/json"), (CL, b"99999999"), (CL, b"12")],
    [(CT, b"application/json"), (CL, b"nope")],
    [(CT, b"application/json"), (CL, b" 42 ")],
    [(CT, b"application/json"), (CL, b"-5")],
    [(CT, b"application/json"), (CL, str(1 << 70).encode())],
    [(CT, b"")],
    [(CT, b"application/jsonx")],
]


@pytest.mark.parametrize("headers", CASES)
def test_one_pass_matches_the_two_checks(headers: list[tuple[bytes, bytes]]) -> None:
    assert (_json_within(headers) <= LIMIT) == _reference(headers)


TE = b"transfer-encoding"
DIRECT_ONLY_REFUSED = [
    [(CT, b"application/json"), (CL, b"12"), (TE, b"chunked")],
    [(CT, b"application/json"), (TE, b"chunked")],
    [(CT, b"application/json"), (CL, b"12"), (CL, b"12")],
    [(CT, b"application/json"), (CL, b"+12")],
    [(CT, b"application/json"), (CL, b"0x10")],
]


@pytest.mark.parametrize("headers", CASES + DIRECT_ONLY_REFUSED)
def test_the_direct_routes_check_is_the_fast_paths_or_stricter(headers: list[tuple[bytes, bytes]]) -> None:
    """``_announced_json`` (the protocol's direct route, headers lower-cased by uvicorn) takes a
    request only where the fast path would serve it, with the same announced length; it leaves to
    the application every head with a repeated or missing Content-Length or a transfer coding."""
    lowered = [(n.lower(), v) for n, v in headers]
    direct = _announced_json(lowered)
    if direct >= 0:
        assert _json_within(lowered) == direct and _reference(lowered) == (direct <= LIMIT)
    names = [n for n, _ in lowered]
    if names.count(CL) != 1 or TE in names or names.count(CT) != 1:
        assert direct == -1
    if headers in DIRECT_ONLY_REFUSED:
        assert direct == -1
