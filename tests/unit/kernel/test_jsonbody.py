"""kernel.jsonbody: request bodies are application/json, decoded strictly, keys never repeated."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from litestar.exceptions import ValidationException

from kernel import jsonbody
from kernel.errors import UnsupportedMediaType
from kernel.jsonbody import (
    BodyRejected,
    check_content_type,
    content_type_of,
    decode_strict,
    has_duplicate_keys,
    is_json_media_type,
)


class Body(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    cost: int = 1


@pytest.mark.parametrize("value, ok", [
    ("application/json", True),
    ("Application/JSON; charset=utf-8", True),
    ('application/json; charset="UTF8"', True),
    ("application/json; charset=latin-1", False),
    ("application/jsonx", False),
    ("text/plain", False),
    (None, False),
    ("", False),
])
def test_json_media_types(value, ok):
    assert is_json_media_type(value) is ok


def test_one_content_type_header_only_and_a_415_otherwise():
    assert content_type_of([(b"Content-Type", b"application/json")]) == "application/json"
    assert content_type_of([(b"accept", b"*/*")]) is None
    with pytest.raises(UnsupportedMediaType):
        content_type_of([(b"content-type", b"application/json"), (b"content-type", b"text/plain")])
    with pytest.raises(UnsupportedMediaType) as e:
        check_content_type("text/plain")
    assert e.value.extra == {"accept": "application/json"}


def test_decode_strict_decodes_without_coercion():
    assert decode_strict(b'{"id": "a", "cost": 3}', Body) == Body("a", 3)
    with pytest.raises(ValidationException) as e:
        decode_strict(b'{"id": "a", "cost": "3"}', Body)  # a string is not an int here
    assert e.value.extra[0]["key"] == "cost"
    with pytest.raises(ValidationException):
        decode_strict(b'{"id": "a", "other": 1}', Body)


@pytest.mark.parametrize("body", [b'{"id": "a"', b'\xff', b'{"id": "a", "id": "b"}'])
def test_malformed_bodies_are_400s(body):
    with pytest.raises(BodyRejected):
        decode_strict(body, Body)


@pytest.mark.parametrize("body, repeated", [
    (b'{"a":1,"b":{"a":2}}', False),  # the same key in another object is fine
    (b'{"a":1,"a":2}', True),
    (b'{"a" :1,"a":2}', True),  # whitespace before the colon: the exact path
    (b'{"a":"x\\":","b":1}', False),  # an escaped quote inside a string
    (b'{"a":":","b":{"c":1,"c":2}}', True),
    (b'[{"k":1},{"k":2}]', False),
])
def test_repeated_keys_are_found_exactly(body, repeated):
    assert has_duplicate_keys(body) is repeated


@settings(max_examples=2_000, deadline=None)
@given(body=st.binary(max_size=60) | st.lists(st.sampled_from([b'"', b":", b" ", b"\t", b"\n", b"\r", b"\x0b", b"\x0c",
                                                             b"\x1c", b"\x85", b"\xa0", b"a", b"{", b","]),
                                            max_size=30).map(b"".join))
def test_ws_before_colon_is_its_pattern(body):
    """The six quote-and-whitespace pairs decide a body without any, the pattern the rest: the same
    answer as the pattern's search everywhere (bytes: \\s is exactly b" \\t\\n\\r\\x0b\\x0c")."""
    assert jsonbody.ws_before_colon(body) == (jsonbody._WS_BEFORE_COLON.search(body) is not None)
