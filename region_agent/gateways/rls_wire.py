"""An RLS call's answer as the bytes of Envoy's ``RateLimitResponse``, written directly.

The answer is :func:`.answer.rls_answer`'s (the same fields, statuses, headers, body and dynamic
metadata; :func:`.rls.to_proto` builds it as a protobuf message), encoded without building a
message: the servicer hands grpcio these bytes (the method is registered without a response
serializer). Building the message and having grpcio serialise it cost about 6 us of the event
loop's thread per call; most of an answer repeats from call to call, so what repeats is encoded
once and remembered (:class:`AnswerWire`): a descriptor's status per (rule, code, remaining,
reset), a rule's ``current_limit`` per snapshot, a header per (name, value).

The wire format (proto3, ``envoy/service/ratelimit/v3/rls.proto``), fields in number order as
protobuf writes them, default values left out as protobuf leaves them out::

    RateLimitResponse: overall_code 1 (varint), statuses 2, response_headers_to_add 3,
                       raw_body 5 (bytes), dynamic_metadata 6 (google.protobuf.Struct)
    DescriptorStatus:  code 1, current_limit 2, limit_remaining 3 (uint32), duration_until_reset 4
    RateLimit:         requests_per_unit 1 (uint32), unit 2 (enum), name 3
    HeaderValue:       key 1, value 2
    Duration:          seconds 1 (int64), nanos 2 (int32)
    Struct:            fields 1 (map<string, Value>); Value: number_value 2 (double), string_value 3

A value protobuf refuses (a count past uint32) raises ``ValueError`` here too: the call fails as
it did. tests/unit/region_agent/gateways/test_rls_wire.py parses these bytes with protobuf and
compares them with :func:`.rls.to_proto`'s message over many drawn decisions.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

from ..decision.plan import Snapshot
from ..models import AdmitRequest, Decision
from .answer import PROBLEM_TYPE, _encode, deciding, per_unit

OK, OVER_LIMIT = 1, 2  # RateLimitResponse.Code
UNIT_CODES = {"UNKNOWN": 0, "SECOND": 1, "MINUTE": 2, "HOUR": 3, "DAY": 4, "MONTH": 5, "YEAR": 6, "WEEK": 7}
UINT32_MAX = 0xFFFF_FFFF
INT64_MAX = 0x7FFF_FFFF_FFFF_FFFF
MEMO_MAX = 4_096  # statuses and headers remembered (each memo starts again empty when full)

_SMALL = [bytes((i,)) for i in range(0x80)]
_double = struct.Struct("<d").pack


def varint(n: int) -> bytes:
    """A non-negative integer as a protobuf varint."""
    if n < 0x80:
        return _SMALL[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field (``tag``: field number << 3 | 2)."""
    return _SMALL[tag] + varint(len(payload)) + payload


def _uint32(n: int) -> int:
    if n > UINT32_MAX:
        raise ValueError(f"Value out of range: {n}")  # as protobuf refuses it
    return n


def limit_field(requests_per_unit: int, unit: str, name: str) -> bytes:
    """``current_limit`` (field 2 of a DescriptorStatus) of a rule."""
    body = b""
    if requests_per_unit:
        body += b"\x08" + varint(_uint32(requests_per_unit))
    code = UNIT_CODES[unit]
    if code:
        body += b"\x10" + _SMALL[code]
    if name:
        body += _field(0x1A, name.encode())
    return _field(0x12, body)


def status_field(code: int, limit: bytes, remaining: int, reset_ms: int) -> bytes:
    """One DescriptorStatus (field 2 of the response): ``limit`` its current_limit field (b'': none)."""
    body = b"\x08" + _SMALL[code] + limit
    if remaining:
        body += b"\x18" + varint(_uint32(remaining))
    if reset_ms:
        seconds, nanos = reset_ms // 1000, (reset_ms % 1000) * 1_000_000
        if seconds > INT64_MAX:
            raise ValueError(f"Value out of range: {seconds}")
        duration = (b"\x08" + varint(seconds) if seconds else b"") + (b"\x10" + varint(nanos) if nanos else b"")
        body += _field(0x22, duration)
    return _field(0x12, body)


def header_field(key: str, value: str) -> bytes:
    """One HeaderValue of ``response_headers_to_add`` (field 3)."""
    body = (_field(0x0A, key.encode()) if key else b"") + (_field(0x12, value.encode()) if value else b"")
    return _field(0x1A, body)


def _value(v: object) -> bytes:
    """A google.protobuf.Value of what :func:`.answer.rls_answer` puts in the metadata (as
    ``Struct.update`` sets it: a number as a double, a string as a string, even empty)."""
    if isinstance(v, str):
        return _field(0x1A, v.encode())
    if isinstance(v, int | float) and not isinstance(v, bool):
        return b"\x11" + _double(float(v))
    raise TypeError(f"dynamic metadata value of type {type(v).__name__}")


def metadata_field(metadata: Mapping[str, object]) -> bytes:
    """``dynamic_metadata`` (field 6): every key prefixed ``leasehold_``."""
    entries = b"".join(_field(0x0A, _field(0x0A, f"leasehold_{k}".encode()) + _field(0x12, _value(v)))
                       for k, v in metadata.items())
    return _field(0x32, entries)


_BARE = (b"\x12\x02\x08\x01", b"\x12\x02\x08\x02")  # an anonymous question's status: the code alone
_CODE = (b"\x08\x01", b"\x08\x02")  # overall_code OK, OVER_LIMIT


class AnswerWire:
    """The answers of one servicer, as bytes (module doc). Remembers per snapshot: a new
    snapshot (a policy reload) starts its memos again."""

    __slots__ = ("_headers", "_limits", "_snap", "_statuses")

    def __init__(self) -> None:
        self._snap: object = None
        self._limits: dict[str, bytes] = {}  # rule id -> its current_limit field
        self._statuses: dict[tuple[str | None, bool, int, int], bytes] = {}
        self._headers: dict[tuple[str, str], bytes] = {}

    def answer(self, decisions: list[Decision], questions: list[AdmitRequest], snap: Snapshot
               ) -> tuple[bytes, int, int]:
        """(the response's bytes, the HTTP status /v1/admit would answer, descriptors
        ``OVER_LIMIT``) of one call's ``decisions``; the same answer as :func:`.rls.to_proto`."""
        if len(decisions) == 1 and len(questions) == 1:
            return self.answer_one(decisions[0], questions[0], snap)
        if snap is not self._snap:
            self._renew(snap)
        parts = [b""]  # overall_code, set below
        over = 0
        for d, q in zip(decisions, questions, strict=True):
            out = d.http_status != 200
            over += out
            parts.append(self._status(d, q, snap, out))
        top = deciding(decisions)
        parts[0] = _CODE[top.http_status != 200]
        return self._end(parts, top), top.http_status, over

    def answer_one(self, d: Decision, q: AdmitRequest, snap: Snapshot) -> tuple[bytes, int, int]:
        """:meth:`answer` of a call of one question (one descriptor, the common call): the same
        bytes, without the lists of a call of several."""
        if snap is not self._snap:
            self._renew(snap)
        out = d.http_status != 200
        return self._end([_CODE[out], self._status(d, q, snap, out)], d), d.http_status, 1 if out else 0

    def _renew(self, snap: Snapshot) -> None:
        """A new snapshot (a policy reload): its rules' statuses and limits are built again."""
        self._snap = snap
        self._limits = {}
        self._statuses = {}

    def _status(self, d: Decision, q: AdmitRequest, snap: Snapshot, out: bool) -> bytes:
        """The DescriptorStatus of ``d``, the decision of question ``q`` (``out``: not 200)."""
        # an address-window denial of an authenticated question is the pre-auth stage's: anonymous too
        if q.principal.type == "anonymous" or q.auth_failed or d.denied_scope == "ip":
            return _BARE[out]  # no policy names, limits or counts (.answer.descriptor_answer)
        reset = d.retry_after_ms if out and d.retry_after_ms > 0 else 0
        rule_id = d.rule_id
        rule = snap.rules_by_id.get(rule_id) if rule_id else None
        if rule is None or d.fallback or d.limit is None:
            rule_id, remaining = None, 0  # no rule, or a local fallback allowance: no current_limit
        else:
            remaining = d.remaining or 0
            if remaining < 0:
                remaining = 0
        key = (rule_id, out, remaining, reset)
        statuses = self._statuses
        st = statuses.get(key)
        if st is None:
            limit = b""
            if rule_id is not None:
                limit = self._limits.get(rule_id)  # type: ignore[assignment]  # (None: not yet built)
                if limit is None:
                    pu = per_unit(rule, snap)  # type: ignore[arg-type]  # rule_id is not None: a rule
                    rpu, unit = pu if pu is not None else (0, "UNKNOWN")
                    limit = self._limits[rule_id] = limit_field(rpu, unit, rule_id)
            st = status_field(OVER_LIMIT if out else OK, limit, remaining, reset)
            if len(statuses) >= MEMO_MAX:
                statuses.clear()
            statuses[key] = st
        return st

    def _end(self, parts: list[bytes], top: Decision) -> bytes:
        """``parts`` (the overall code and the statuses) with the answer's headers, body and
        metadata, which follow the deciding decision ``top``, joined."""
        if top.http_status != 200:
            headers = dict(top.headers)
            headers["content-type"] = PROBLEM_TYPE
            parts.extend(header_field(k, v) for k, v in headers.items())
            body = _encode(top.problem or {"status": top.http_status})
            if body:
                parts.append(_field(0x2A, body))
            parts.append(metadata_field({"status": top.http_status, "reason": top.reason or ""}))
        elif top.headers:
            memo = self._headers
            for kv in top.headers.items():
                h = memo.get(kv)
                if h is None:
                    h = header_field(*kv)
                    if len(memo) >= MEMO_MAX:
                        memo.clear()
                    memo[kv] = h
                parts.append(h)
        return b"".join(parts)


__all__ = ["AnswerWire", "header_field", "limit_field", "metadata_field", "status_field", "varint"]
