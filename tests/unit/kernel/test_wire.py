"""kernel.wire: the lease API's wire types refuse what the allocator must never act on."""

from __future__ import annotations

import msgspec
import pytest

from kernel.wire import (
    MAX_BATCH,
    LeaseBatchRequest,
    LeaseBatchResponse,
    LeaseError,
    LeaseGrant,
    LeaseRequest,
    UsageReport,
    WindowRef,
)

REQ = {"leaseId": "eu-0123456789", "region": "eu", "pool": "global-read", "want": 10}


def decode(doc, typ):
    return msgspec.json.decode(msgspec.json.encode(doc), type=typ)


def test_a_lease_request_round_trips_in_camel_case_with_defaults():
    req = decode(REQ, LeaseRequest)
    assert (req.lease_id, req.want, req.demand, req.window) == ("eu-0123456789", 10, 0, "current")
    assert msgspec.json.decode(msgspec.json.encode(req))["leaseId"] == "eu-0123456789"


@pytest.mark.parametrize("change", [
    {"want": 0},  # a lease of nothing
    {"want": 2**41},  # past the token range
    {"demand": -1},
    {"window": "previous"},
    {"leaseId": "short"},
    {"leaseId": "eu-0123456789\n"},
    {"region": "EU"},
    {"extra": 1},  # unknown fields are refused, not ignored
])
def test_a_lease_request_refuses(change):
    with pytest.raises(msgspec.ValidationError):
        decode({**REQ, **change}, LeaseRequest)


def test_batches_are_bounded_both_ways():
    with pytest.raises(msgspec.ValidationError):
        decode({"requests": []}, LeaseBatchRequest)
    with pytest.raises(msgspec.ValidationError):
        decode({"requests": [REQ] * (MAX_BATCH + 1)}, LeaseBatchRequest)
    assert len(decode({"requests": [REQ] * MAX_BATCH}, LeaseBatchRequest).requests) == MAX_BATCH


def test_a_usage_report_omits_closed_early_unless_set():
    plain = UsageReport(lease_id="eu-0123456789", region="eu", pool="p", spent=3)
    assert "closedEarly" not in msgspec.json.decode(msgspec.json.encode(plain))
    early = UsageReport(lease_id="eu-0123456789", region="eu", pool="p", spent=0, closed_early=True)
    assert msgspec.json.decode(msgspec.json.encode(early))["closedEarly"] is True
    with pytest.raises(msgspec.ValidationError):
        decode({"leaseId": "eu-0123456789", "region": "eu", "pool": "p", "spent": -1}, UsageReport)


def test_batch_results_encode_as_grants_or_errors_in_request_order():
    grant = LeaseGrant(lease_id="eu-0123456789", pool="p", region="eu", granted=5,
                       window=WindowRef(index=3, start_ms=3_000, end_ms=4_000), expires_at_ms=3_900, ttl_ms=400,
                       starts_in_ms=0, epoch=9, issued_at_ms=3_500, remaining=95)
    error = LeaseError(lease_id="eu-1123456789", status=409, code="conflict", detail="used for another pool")
    results = msgspec.json.decode(msgspec.json.encode(LeaseBatchResponse(results=[grant, error])))["results"]
    # an untagged union on the wire: a client tells the two apart by their members
    assert decode(results[0], LeaseGrant) == grant and "status" not in results[0]
    assert decode(results[1], LeaseError) == error and "granted" not in results[1]
