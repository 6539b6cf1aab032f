"""``pool_refund.lua`` on real Redis (standalone and cluster): a chunk part's unspent rest goes back
to the leases its ``pool_take`` debited, at most what it took from each, latest-expiring first, once
per refund id; never to a closed entry, an entry of another incarnation, or one whose debit is
not in it any more."""

from __future__ import annotations

import pytest

from kernel.algorithms.pool import PoolEntry
from kernel.errors import ScriptRejected

from .support import now_ms

pytestmark = pytest.mark.integration

T = "{t:refund}"
KEY = f"rl:v3:{T}:pool:p"


def rec(name: str) -> str:
    return f"rl:v3:{T}:refund:{name}"


async def _entry(aclient, lease: str) -> PoolEntry | None:
    v = await aclient.hget(KEY, lease)
    return None if v is None else PoolEntry.decode(v.decode())


async def _two_leases_and_a_take(aclient, scripts, t: int) -> tuple[tuple[str, int], ...]:
    dep = dict(valid_from_ms=t - 10, max_entries=8, slack_ms=1_000)
    assert (await scripts.pool_deposit(aclient, KEY, "A", granted=5, expires_at_ms=t + 60_000, **dep)).stored
    assert (await scripts.pool_deposit(aclient, KEY, "B", granted=10, expires_at_ms=t + 120_000, **dep)).stored
    got = await scripts.pool_take(aclient, KEY, min_tokens=1, want=8, slack_ms=0)
    assert (got.taken, got.debits) == (8, (("A", 5), ("B", 3)))  # what it took from each, earliest first
    return got.debits


async def test_a_refund_gives_back_latest_expiring_first_and_only_once(aclient, scripts):
    t = now_ms()
    debits = await _two_leases_and_a_take(aclient, scripts, t)
    r = await scripts.pool_refund(aclient, KEY, rec("p1"), tokens=6, slack_ms=1_000, debits=debits)
    assert (r.refunded, r.replay) == (6, False)
    # B (the later end) gets back all 3 taken from it, A the other 3 of its 5
    assert (await _entry(aclient, "B")).spent == 0 and (await _entry(aclient, "A")).spent == 2
    assert (await scripts.pool_balance(aclient, KEY)).spendable() == 13
    # the record outlives the named leases' end plus the slack (a replay then finds them ended)
    ttl = await aclient.pttl(rec("p1"))
    assert ttl >= 120_000 + 1_000 - (now_ms() - t) - 1  # (ms rounding of TIME and PTTL)
    # a retry of the same refund changes nothing and says what the first one gave back
    before = await aclient.dump(KEY)
    r = await scripts.pool_refund(aclient, KEY, rec("p1"), tokens=6, slack_ms=1_000, debits=debits)
    assert (r.refunded, r.replay) == (6, True)
    assert await aclient.dump(KEY) == before
    # a closed lease reports what was given back as unspent
    closed = await scripts.pool_close(aclient, KEY, "A")
    assert closed is not None and (closed.granted, closed.spent, closed.current) == (5, 2, True)


async def test_a_refund_never_exceeds_the_debit_nor_goes_below_zero(aclient, scripts):
    t = now_ms()
    await _two_leases_and_a_take(aclient, scripts, t)
    # more tokens than the part took from the named lease: only what was debited from it
    r = await scripts.pool_refund(aclient, KEY, rec("more"), tokens=9, slack_ms=1_000, debits=[("B", 3)])
    assert r.refunded == 3 and (await _entry(aclient, "B")).spent == 0
    # a lease whose spent is below the claimed debit (the debit is not in it any more): untouched
    r = await scripts.pool_refund(aclient, KEY, rec("gone"), tokens=3, slack_ms=1_000, debits=[("B", 3)])
    assert r.refunded == 0 and (await _entry(aclient, "B")).spent == 0
    r = await scripts.pool_refund(aclient, KEY, rec("big"), tokens=9, slack_ms=1_000, debits=[("A", 6)])
    assert r.refunded == 0 and (await _entry(aclient, "A")).spent == 5


async def test_a_refund_to_a_closed_or_restored_or_long_ended_lease_does_nothing(aclient, scripts):
    t = now_ms()
    debits = await _two_leases_and_a_take(aclient, scripts, t)
    assert await scripts.pool_close(aclient, KEY, "A") is not None
    # A is closed (its spent already reported): only B's 3 come back
    r = await scripts.pool_refund(aclient, KEY, rec("closed"), tokens=8, slack_ms=1_000, debits=debits)
    assert r.refunded == 3 and await _entry(aclient, "A") is None
    # an entry restored from an older incarnation of the node may have lost the debit: untouched
    await aclient.hset(KEY, "OLD", f"10,4,{t - 10},{t + 60_000},ab12")
    r = await scripts.pool_refund(aclient, KEY, rec("old"), tokens=4, slack_ms=1_000, debits=[("OLD", 4)])
    assert r.refunded == 0 and (await aclient.hget(KEY, "OLD")).decode() == f"10,4,{t - 10},{t + 60_000},ab12"
    # a lease that ended more than the slack ago: untouched; within the slack (not closed yet): given back
    inc = (await scripts.pool_balance(aclient, KEY)).incarnation
    await aclient.hset(KEY, "END", f"10,4,{t - 20_000},{t - 10_000},{inc}")
    r = await scripts.pool_refund(aclient, KEY, rec("end1"), tokens=4, slack_ms=5_000, debits=[("END", 4)])
    assert r.refunded == 0 and (await _entry(aclient, "END")).spent == 4
    r = await scripts.pool_refund(aclient, KEY, rec("end2"), tokens=4, slack_ms=60_000, debits=[("END", 4)])
    assert r.refunded == 4 and (await _entry(aclient, "END")).spent == 0
    # a refund that found nothing is recorded too (its answer is final) and wrote no entry
    assert await aclient.get(rec("old")) == b"0" and await aclient.pttl(rec("old")) > 0


BAD = [
    ["0", "1000", "A", "1"],  # tokens 0
    ["nan", "1000", "A", "1"],
    ["1.5", "1000", "A", "1"],
    ["1", "-1", "A", "1"],  # slack < 0
    ["1", "1000"],  # no lease
    ["1", "1000", "A"],  # an odd pair
    ["1", "1000", "A", "0"],  # debited 0
    ["1", "1000", "A", "inf"],
    ["1", "1000", "", "1"],  # empty lease id
    ["2", "1000", "A", "1", "A", "1"],  # the same lease twice (its debit counted twice)
    ["1", "1000", *[x for i in range(17) for x in (f"L{i}", "1")]],  # more than 16 leases
]


@pytest.mark.parametrize("argv", BAD)
async def test_bad_arguments_rejected_before_any_write(aclient, scripts, argv):
    t = now_ms()
    await aclient.hset(KEY, "A", f"5,5,{t - 10},{t + 60_000},{(await scripts.pool_balance(aclient, KEY)).incarnation}")
    before = await aclient.dump(KEY)
    with pytest.raises(ScriptRejected):
        await scripts.call(aclient, "pool_refund", [KEY, rec("bad")], argv)
    assert await aclient.dump(KEY) == before and await aclient.exists(rec("bad")) == 0
