"""The pure parts of hot key set chunks (region_agent.leasing.hot_chunks): the attempt-rate
detector, chunk sizing and a chunk's spending, each with the clock passed in; and which plans
can be chunked."""

from __future__ import annotations

import msgspec
import pytest

from kernel.algorithms import HotChunk
from kernel.bundle import Bundle, make_rule, seal, validate_bundle
from kernel.errors import PolicyError
from region_agent.decision.keys import KeyBuilder
from region_agent.decision.plan import Snapshot, build_plan
from region_agent.leasing.hot_chunks import AttemptRate, KeySetChunk, chunk_units, hot_config
from region_agent.models import AdmitRequest, Principal

HOT = HotChunk(threshold_per_s=100, chunk_max=50, validity_ms=400)


# ---------------------------------------------------------------------------- the rate detector
def test_the_rate_counts_the_last_second():
    r = AttemptRate()
    for i in range(200):  # 200 attempts over 0.5 s
        r.note(1, 10_000.0 + i * 2.5)
    assert r.per_s(10_500.0) == pytest.approx(200)
    assert r.per_s(11_000.0) == pytest.approx(200)  # the bucket ended; still inside the last second
    assert r.per_s(11_500.0) == pytest.approx(100, abs=1)  # half of that second is left of the span
    assert r.per_s(12_000.5) == pytest.approx(0, abs=1)
    assert r.per_s(20_000.0) == 0  # a long quiet spell forgets everything


def test_the_rate_counts_units_not_requests():
    r = AttemptRate()
    r.note(5, 0.0)
    r.note(5, 10.0)
    assert r.per_s(20.0) == 10


def test_a_key_set_crosses_the_threshold_only_at_that_rate():
    slow, fast = AttemptRate(), AttemptRate()
    for i in range(1_000):
        slow.note(1, i * 20.0)  # 50 per second
        fast.note(1, i * 5.0)  # 200 per second
    assert slow.per_s(20_000.0) < HOT.threshold_per_s <= fast.per_s(5_000.0)


# ---------------------------------------------------------------------------- sizing
def test_a_chunk_holds_half_a_validity_of_demand_within_its_bounds():
    assert chunk_units(1_000.0, 400, 1, 50, 50) == 50  # 200 asked over half a validity: chunkMax
    assert chunk_units(100.0, 400, 1, 50, 50) == 20
    assert chunk_units(1.0, 400, 1, 50, 50) == 2  # at least two units (one for the asker)
    assert chunk_units(100.0, 400, 30, 50, 50) == 30  # at least the asker's cost


def test_a_chunk_never_exceeds_what_the_keys_still_allow_this_process():
    assert chunk_units(1_000.0, 400, 1, 50, 7) == 7
    assert chunk_units(1_000.0, 400, 3, 50, 2) == 0  # no room for the asker: it asks alone


# ---------------------------------------------------------------------------- spending
def test_a_chunk_pays_until_spent_or_expired_and_counts_what_it_abandons():
    c = KeySetChunk()
    c.parts.grant(3, 0.0, 1_000)
    assert c.spend(2, 100.0) and c.usable(100.0) == 1
    assert not c.spend(2, 200.0) and c.usable(200.0) == 1  # cannot pay two
    assert not c.spend(1, 1_000.0)  # its validity ended
    assert c.parts.take_abandoned() == 1


def test_a_new_part_does_not_extend_what_an_older_one_holds():
    c = KeySetChunk()
    c.parts.grant(2, 0.0, 300)
    c.parts.grant(5, 200.0, 300)
    assert c.usable(250.0) == 7
    assert c.spend(1, 250.0) and c.usable(299.0) == 6
    assert c.usable(300.0) == 5 and c.parts.take_abandoned() == 1  # the older part ended at its own time


# ---------------------------------------------------------------------------- which plans
def _bundle(*rules) -> Bundle:
    return seal(Bundle(bundle_version=3, published_at="2026-12-01T00:00:00Z", checksum="", rules=list(rules)))


def _tb(rule_id: str, tenant: str | None, scope: str = "tenant", **kw):
    return make_rule(id=rule_id, scope=scope, tenant=tenant, algorithm="token_bucket", fail_mode="closed",
                     capacity_millis=100_000, refill_millis=10_000, period_ms=1_000, cost_millis=1_000, **kw)


def _plan(bundle: Bundle, cost: int = 1):
    req = AdmitRequest(request_id="r-000000000001", tenant_id="acme", principal=Principal(type="user", id="U-1"),
                       route_group="read", cost_hint=cost)
    return build_plan(Snapshot(bundle), req, KeyBuilder(b"pepper"))


def test_a_plan_is_chunked_only_when_every_rule_asks_for_it():
    both = _bundle(_tb("a", "acme", hot_chunk=HOT), _tb("b", None, "user", hot_chunk=msgspec.structs.replace(
        HOT, threshold_per_s=300, chunk_max=20, validity_ms=900)))
    cfg = hot_config(_plan(both))
    assert cfg is not None
    assert cfg.threshold_per_s == 300 and cfg.validity_ms == 400 and sorted(cfg.chunk_max) == [20, 50]
    assert cfg.unit_cost == (1_000, 1_000)  # millitokens of one unit, per slot
    assert hot_config(_plan(_bundle(_tb("a", "acme", hot_chunk=HOT), _tb("b", None, "user")))) is None


def test_the_unit_is_the_same_for_every_cost():
    b = _bundle(_tb("a", "acme", hot_chunk=HOT))
    assert hot_config(_plan(b, 1)).unit_argv == hot_config(_plan(b, 7)).unit_argv


@pytest.mark.parametrize("kw", [{"idempotent": True}, {"concurrency_max": 3}, {"scope": "ip", "tenant": None}])
def test_a_rule_a_chunk_cannot_serve_does_not_validate(kw):
    fields = {"id": "a", "scope": "tenant", "tenant": "acme", "algorithm": "fixed_window", "fail_mode": "closed",
              "limit": 10, "window_ms": 1_000, "hot_chunk": HOT, **kw}
    with pytest.raises(PolicyError, match="hotChunk"):
        validate_bundle(_bundle(make_rule(**fields)))
