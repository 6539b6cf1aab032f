"""The RLS door's answer written as bytes (region_agent.gateways.rls_wire.AnswerWire) is the answer
protobuf builds (region_agent.gateways.rls.to_proto): drawn decisions of every kind — allowed and
denied, 429/503/409, rules with and without Envoy units, fallbacks, anonymous and address-window
questions, headers (empty and non-ASCII values), problem bodies and dynamic metadata — parse to
the same message, byte for byte where protobuf's own order is fixed (no map), and the HTTP
status and the count of OVER_LIMIT descriptors are those the servicer reports. Values protobuf
refuses are refused too; the memos give the same bytes the second time; a call of one question
answered without the lists (``AnswerWire.answer_one``) is the same answer."""

from __future__ import annotations

import random

import pytest
from envoy.service.ratelimit.v3 import rls_pb2

from kernel.bundle import load_bundle_file
from region_agent.decision.plan import Snapshot
from region_agent.gateways.rls import to_proto
from region_agent.gateways.rls_wire import AnswerWire, varint
from region_agent.models import AdmitRequest, Decision, DeniedScope, Principal, Reason

Response = rls_pb2.RateLimitResponse
SNAP = Snapshot(load_bundle_file("policies/northstar.json"))
RULES = [*sorted(SNAP.rules_by_id), "not-in-the-bundle", None]


def question(rng: random.Random) -> AdmitRequest:
    kind = rng.choice(["user", "user", "user", "anonymous", "failed"])
    if kind == "anonymous":
        return AdmitRequest(request_id="r-12345678", principal=Principal(type="anonymous", id="203.0.113.9"),
                            route_group="login")
    return AdmitRequest(request_id="r-12345678", principal=Principal(type="user", id="U-1"), route_group="read",
                        tenant_id="atlas", auth_failed=kind == "failed", client_ip="203.0.113.9")


def decision(rng: random.Random) -> Decision:
    status = rng.choice([200, 200, 200, 429, 429, 503, 409])
    headers = rng.choice([{}, {"RateLimit-Policy": '"read-user-v3";q=20;w=10', "RateLimit": f'"r";r={rng.randrange(30)};t=0'},
                          {"Retry-After": str(rng.randrange(1, 9))}, {"X-Empty": "", "X-Ü": "wert ü €"},
                          {"content-type": "text/plain", "Retry-After": "2"}])
    return Decision(
        allowed=status == 200, decision_id="r-12345678", rule_id=rng.choice(RULES), bundle_version=42,
        denied_scope=rng.choice([None, None, DeniedScope.IP, DeniedScope.USER]),
        reason=None if status == 200 else rng.choice([None, Reason.RATE_EXCEEDED, Reason.LIMITER_UNAVAILABLE]),
        limit=rng.choice([None, 20, 5000]), remaining=rng.choice([None, -3, 0, 1, 19, 127, 128, 300, 70_000, 2**31]),
        retry_after_ms=rng.choice([0, -1, 1, 999, 1000, 1500, 86_400_123]), fallback=rng.random() < 0.2,
        http_status=status, headers=headers,
        problem=rng.choice([None, {"status": status, "title": "Too Many Requests", "detail": "ü"}]))


@pytest.mark.parametrize("seed", range(8))
def test_the_bytes_parse_to_protobufs_answer(seed):
    rng = random.Random(seed)
    wire, one = AnswerWire(), AnswerWire()
    for _ in range(500):
        n = rng.choice([1, 1, 1, 2, 3])
        ds, qs = [decision(rng) for _ in range(n)], [question(rng) for _ in range(n)]
        raw, status, over = wire.answer(ds, qs, SNAP)
        if n == 1:  # the servicer's call of one question: the same answer without the lists
            assert one.answer_one(ds[0], qs[0], SNAP) == (raw, status, over)
        message, want_status = to_proto(ds, qs, SNAP)
        assert Response.FromString(raw) == message
        assert status == want_status and over == sum(s.code == Response.OVER_LIMIT for s in message.statuses)
        if not message.HasField("dynamic_metadata"):  # (a map's order is protobuf's own)
            assert raw == message.SerializeToString()
        assert wire.answer(ds, qs, SNAP)[0] == raw  # remembered parts: the same bytes


def test_counts_protobuf_refuses_are_refused():
    q = AdmitRequest(request_id="r-12345678", principal=Principal(type="user", id="U-1"), route_group="read",
                     tenant_id="atlas")
    d = Decision(allowed=True, decision_id="r-1", rule_id="read-user-v3", bundle_version=42, limit=20,
                 remaining=2**32)
    with pytest.raises(ValueError):
        to_proto([d], [q], SNAP)
    with pytest.raises(ValueError):
        AnswerWire().answer([d], [q], SNAP)
    with pytest.raises(ValueError):
        AnswerWire().answer_one(d, q, SNAP)


def test_varint():
    for n in (0, 1, 127, 128, 300, 16_383, 16_384, 2**32 - 1, 2**63 - 1):
        m = Response(statuses=[Response.DescriptorStatus(limit_remaining=n)]) if n < 2**32 else None
        if m is not None:
            assert m.statuses[0].SerializeToString() == (b"\x18" + varint(n) if n else b"")
        v = varint(n)
        assert sum((b & 0x7F) << (7 * i) for i, b in enumerate(v)) == n
        assert all(b & 0x80 for b in v[:-1]) and not v[-1] & 0x80
