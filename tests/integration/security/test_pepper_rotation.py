"""Rotating the pepper (docs/store-hygiene.md, "Rotating the pepper"): a rolling restart from
pepper P1 to P2 puts agents of both on one Redis for a while. What that costs, exactly as
documented, with two in-process agents on one real redis-server:

* principal-keyed state (user, key and ip buckets, decision records) is re-keyed: under P2 a
  principal starts with a full bucket — at most one bucket's capacity more for it, once;
* tenant- and route-keyed state is not hashed, so it is shared: the tenant's limit holds
  throughout the rotation;
* a decision record written under P1 does not answer under P2: an idempotent request retried
  across the two is decided again (charged again);
* the old keys leave by their own TTL (a bucket: its refill time plus slack), nothing to clean up;
* neither pepper, nor a raw principal id, is in any key.
"""

from __future__ import annotations

from pathlib import Path

from litestar.testing import AsyncTestClient
from redis.asyncio import Redis

from region_agent.decision.keys import KeyBuilder
from region_agent.service.app import create_app
from tests.support.agent import admit_json, make_settings
from tests.support.policies import northstar, write_bundle
from tests.support.redis_buckets import set_bucket, tenant_key

P1, P2 = b"pepper-one-0123456789abcdef", b"pepper-two-0123456789abcdef"


def user_read(pepper: bytes, user: str = "U-17") -> str:
    return f"rl:v3:{{t:atlas}}:u:{KeyBuilder(pepper).h('atlas', 'u', user)}:read"


async def test_a_rolling_pepper_rotation_costs_what_the_docs_say(redis_url: str, tmp_path: Path):
    policy = tmp_path / "bundle.json"
    write_bundle(policy, northstar())
    r = Redis.from_url(redis_url)
    settings = make_settings(redis_url, policy)
    try:
        await set_bucket(r, tenant_key("atlas"), 640_000)  # frozen: no refill while the test runs
        await set_bucket(r, tenant_key("atlas", "export"), 100_000)
        async with AsyncTestClient(app=create_app(settings, pepper=P1)) as old, \
                AsyncTestClient(app=create_app(settings, pepper=P2)) as new:
            reads_old = [await admit_json(old, f"rot-old-{i:04d}") for i in range(21)]
            assert [d["allowed"] for d in reads_old] == [True] * 20 + [False]  # P-READ under P1
            # the same user on an agent that already runs P2: a fresh bucket (the stated cost)
            reads_new = [await admit_json(new, f"rot-new-{i:04d}") for i in range(21)]
            assert [d["allowed"] for d in reads_new] == [True] * 20 + [False]
            assert user_read(P1) != user_read(P2)
            for key in (user_read(P1), user_read(P2)):  # both drained (less than one token refilled since)
                assert int(await r.hget(key, "tokens")) < 1_000
            # the tenant bucket is one key for both: 40 admissions debited from it, whatever the pepper
            assert int(await r.hget(tenant_key("atlas"), "tokens")) == 640_000 - 40 * 1_000
            # an idempotent export decided under P1 is not replayed under P2: decided (charged) again
            first = await admit_json(old, "rot-export-0001", route="export")
            again_old = await admit_json(old, "rot-export-0001", route="export")
            again_new = await admit_json(new, "rot-export-0001", route="export")
            assert first["allowed"] and again_old["allowed"] and again_new["allowed"]
            # P1's replay charged nothing, P2 charged once more
            assert int(await r.hget(tenant_key("atlas", "export"), "tokens")) == 100_000 - 2 * 10_000
            # the old keys go by their own TTL: P-READ's 10 s refill + 5 s slack
            assert 0 < await r.pttl(user_read(P1)) <= 15_000
            # no pepper and no raw principal id in any key
            names = [k.decode() for k in await r.keys("*")]
            assert names and not [k for k in names if "U-17" in k or "pepper" in k]
    finally:
        await r.aclose()
