"""The agent's rate limit quota service (RLQS) in process against a real Redis, driven by a gRPC
stream client that reports usage as Envoy does (the real Envoy: tests/e2e/gateways/
test_envoy_rlqs.py). Every assignment is funded first from the bucket's rules: the tokens are in
Redis's books before Envoy may spend them; two Envoys of one bucket share what the rules hold,
by demand; a refused bucket is denied and debits nothing; a policy change revokes."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import msgspec
import pytest
from envoy.service.rate_limit_quota.v3 import rlqs_pb2, rlqs_pb2_grpc
from litestar.testing import AsyncTestClient
from redis.asyncio import Redis

from leasehold.local.procs import free_port
from region_agent.decision.keys import KeyBuilder
from region_agent.gateways import rlqs
from region_agent.gateways import rls as rls_door
from region_agent.gateways.refused_callers import RefusedCallers
from region_agent.service.app import create_app
from tests.support.agent import PEPPER, make_settings
from tests.support.policies import northstar, write_bundle
from tests.support.waiting import await_until

pytestmark = pytest.mark.integration

TOKEN = "gw-token-0123456789abcdef"
OPS = "ops-token-0123456789abcdef"
META = (("authorization", f"Bearer {TOKEN}"),)
KEYS = KeyBuilder(PEPPER)


@dataclass
class Envoyish:
    """One RLQS stream, as an Envoy holds it: reports go out, bucket actions come in."""

    call: object
    actions: list = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)

    async def report(self, domain: str = "leasehold", **usage: tuple[dict[str, str], int, int]) -> None:
        msg = rlqs_pb2.RateLimitQuotaUsageReports(domain=domain)
        for bucket, allowed, denied in usage.values():
            u = msg.bucket_quota_usages.add(num_requests_allowed=allowed, num_requests_denied=denied)
            u.bucket_id.bucket.update(bucket)
        await self.call.write(msg)

    async def pump(self) -> None:
        async for resp in self.call:
            self.actions.extend(resp.bucket_action)
            self.event.set()

    async def next_actions(self, n: int = 1, within_s: float = 10.0) -> list:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while len(self.actions) < n:
            self.event.clear()
            await asyncio.wait_for(self.event.wait(), max(0.01, deadline - loop.time()))
        out, self.actions = self.actions[:n], self.actions[n:]
        return out


def user_bucket(user: str = "U-1", tenant: str = "atlas", route: str = "read", **extra: str) -> dict[str, str]:
    return {"tenant": tenant, "user": user, "route_group": route, **extra}


def tokens_of(action) -> int | None:
    s = action.quota_assignment_action.rate_limit_strategy
    return s.token_bucket.max_tokens if s.HasField("token_bucket") else None


def is_deny(action) -> bool:
    s = action.quota_assignment_action.rate_limit_strategy
    return action.HasField("quota_assignment_action") and s.HasField("blanket_rule") and s.blanket_rule == s.DENY_ALL


@pytest.fixture
async def rig(redis_url: str, policy_file: Path) -> AsyncIterator[tuple[AsyncTestClient, grpc.aio.Channel, str]]:
    port = free_port()
    settings = make_settings(redis_url, policy_file, auth_disabled=False, rls_port=port, rlqs_max_ttl_s=10,
                             gateway_tokens=["edge:" + hashlib.sha256(TOKEN.encode()).hexdigest()],
                             operator_tokens=["ops:" + hashlib.sha256(OPS.encode()).hexdigest()])
    app = create_app(settings, pepper=PEPPER)
    async with AsyncTestClient(app=app) as client:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            yield client, ch, redis_url


async def open_stream(ch: grpc.aio.Channel, metadata=META) -> tuple[Envoyish, asyncio.Task]:
    call = rlqs_pb2_grpc.RateLimitQuotaServiceStub(ch).StreamRateLimitQuotas(metadata=metadata)
    e = Envoyish(call)
    return e, asyncio.create_task(e.pump())


async def user_tokens(redis_url: str, user: str = "U-1") -> float:
    r = Redis.from_url(redis_url)
    try:
        v = await r.hget(f"rl:v3:{{t:atlas}}:u:{KEYS.h('atlas', 'u', user)}:read", "tokens")
        return int(v) / 1000 if v is not None else 20.0
    finally:
        await r.aclose()


async def metric(client: AsyncTestClient, name: str, **labels: str) -> float:
    total = 0.0
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
    return total


async def test_a_new_bucket_gets_a_fresh_assignment_funded_from_its_rules(rig):
    client, ch, redis_url = rig
    e, pump = await open_stream(ch)
    try:
        await e.report(b=(user_bucket(), 0, 1))  # Envoy's first report of a bucket: its first request, denied
        deny, tb = await e.next_actions(2)
        # a fresh assignment: deny-all, then a token bucket that does not refill
        assert is_deny(deny) and tokens_of(tb) is not None
        n = tokens_of(tb)
        s = tb.quota_assignment_action.rate_limit_strategy.token_bucket
        assert s.tokens_per_fill.value == 1 and s.fill_interval.seconds >= 10 * 365 * 86_400
        assert 1 <= tb.quota_assignment_action.assignment_time_to_live.seconds <= 10
        assert dict(tb.bucket_id.bucket) == user_bucket()
        assert 1 <= n <= 20
        assert 20 - n - 0.5 <= await user_tokens(redis_url) <= 20 - n + 0.5  # debited before it was sent
        assert await metric(client, "leasehold_agent_rlqs_assigned_tokens_total") == n
        assert await metric(client, "leasehold_agent_decisions_total", rule="read-user-v3") >= 1  # one admission
    finally:
        e.call.cancel()
        pump.cancel()


async def freeze_user_bucket(redis_url: str, user: str, tokens: int) -> None:
    """The user's read bucket holding ``tokens`` and stamped an hour ahead: no refill while the
    test runs (the scripts' clock-backwards clamp), so what it held is all it can give."""
    r = Redis.from_url(redis_url)
    try:
        sec, usec = await r.time()
        key = f"rl:v3:{{t:atlas}}:u:{KEYS.h('atlas', 'u', user)}:read"
        await r.hset(key, mapping={"tokens": tokens * 1000, "ts": int(sec) * 1000 + int(usec) // 1000 + 3_600_000})
        await r.pexpire(key, 600_000)
    finally:
        await r.aclose()


async def test_operators_see_the_assignments_per_bucket(rig):
    client, ch, _ = rig
    e, pump = await open_stream(ch)
    try:
        await e.report(b=(user_bucket("U-7"), 0, 1))
        _, tb = await e.next_actions(2)
        assert (await client.get("/v1/rlqs", headers={"authorization": f"Bearer {TOKEN}"})).status_code in (401, 403)
        view = (await client.get("/v1/rlqs", headers={"authorization": f"Bearer {OPS}"})).json()
        assert view["serving"] is True and len(view["streams"]) == 1
        (bucket,) = [b for b in view["buckets"] if b["bucket"] == user_bucket("U-7")]
        (held,) = bucket["envoys"]
        assert held["live"] and held["tokens"] == tokens_of(tb) == held["funded"] and held["refused"] is None
    finally:
        e.call.cancel()
        pump.cancel()


async def test_two_envoys_of_one_bucket_never_hold_more_than_its_rules_held(rig):
    client, ch, redis_url = rig
    await freeze_user_bucket(redis_url, "U-2", 20)
    a, pa = await open_stream(ch)
    b, pb = await open_stream(ch)
    try:
        await a.report(x=(user_bucket("U-2"), 0, 1))
        await b.report(x=(user_bucket("U-2"), 0, 1))
        first = [tokens_of((await s.next_actions(2))[1]) for s in (a, b)]
        assert all(n >= 1 for n in first) and sum(first) <= 20, first
        # both report heavy use, their assignments spent: the agent funds what is left, no more
        await a.report(x=(user_bucket("U-2"), first[0], 60))
        await b.report(x=(user_bucket("U-2"), first[1], 20))
        for _ in range(100):  # at most about 10 s
            if await metric(client, "leasehold_agent_rlqs_assigned_tokens_total") >= 20:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.5)  # a round more (a denial's retry) would show here
        assigned = await metric(client, "leasehold_agent_rlqs_assigned_tokens_total")
        assert assigned == 20, assigned  # what was left was handed out ...
        assert await user_tokens(redis_url, "U-2") == 0  # ... debited first ...
        # a fresh assignment is a deny-all then the token bucket (a renewal is the token bucket alone)
        fresh = [tokens_of(x) for s in (a, b) for d, x in zip(s.actions, s.actions[1:], strict=False)
                 if is_deny(d) and tokens_of(x) is not None]
        assert sum(first) + sum(fresh) == 20, (first, fresh)  # ... and never more than the rules held
        assert await metric(client, "leasehold_agent_rlqs_rounds_total", outcome="denied") >= 1
    finally:
        for s, p in ((a, pa), (b, pb)):
            s.call.cancel()
            p.cancel()


@pytest.mark.parametrize(("bucket", "reason"), [
    ({"tenant": "atlas", "user": "U-3", "route_group": "read", "unmatched": "true"}, "unknown_key"),
    ({"tenant": "atlas", "route_group": "read"}, "missing_principal"),
    ({"tenant": "atlas", "user": "U-3", "route_group": "export"}, "concurrency_rule"),
])
async def test_a_bucket_it_cannot_answer_is_refused_and_debits_nothing(rig, bucket, reason):
    client, ch, redis_url = rig
    e, pump = await open_stream(ch)
    try:
        await e.report(b=(bucket, 0, 1))
        (act,) = await e.next_actions(1)
        assert is_deny(act) and dict(act.bucket_id.bucket) == bucket
        assert await metric(client, "leasehold_agent_rlqs_refused_total", reason=reason) >= 1
        assert await metric(client, "leasehold_agent_rlqs_assigned_tokens_total") == 0
        r = Redis.from_url(redis_url)
        assert not [k async for k in r.scan_iter("rl:v3:*")]  # nothing decided, nothing debited
        await r.aclose()
    finally:
        e.call.cancel()
        pump.cancel()


async def test_another_domain_is_refused(rig):
    client, ch, _ = rig
    e, pump = await open_stream(ch)
    try:
        await e.report(domain="other", b=(user_bucket("U-4"), 0, 1))
        (act,) = await e.next_actions(1)
        assert is_deny(act)
        assert await metric(client, "leasehold_agent_rlqs_refused_total", reason="unknown_domain") >= 1
    finally:
        e.call.cancel()
        pump.cancel()


async def test_a_stream_without_the_gateway_token_is_unauthenticated(rig, monkeypatch, caplog):
    client, ch, _ = rig
    name = "leasehold_agent_rlqs_unauthenticated_total"
    assert name + " 0.0" in (await client.get("/metrics")).text  # exported from the start: rate() sees the first
    monkeypatch.setattr(rls_door, "refused_callers", RefusedCallers(rls_door.log))
    with caplog.at_level(logging.WARNING, logger=rls_door.log.name):
        for metadata in ((("authorization", "Bearer wrong"),), ()):  # a wrong token, then none
            e, pump = await open_stream(ch, metadata=metadata)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pump  # refused before any report is read
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # every attempt counted (LeaseholdRlqsGatewayRefused, LeaseholdRlqsUnknownCaller) ...
    assert await metric(client, name) == 2
    assert await metric(client, "leasehold_agent_rlqs_streams") == 0  # never opened
    # ... the agent's log names the caller once a minute (docs/runbooks.md, LeaseholdRlqsUnknownCaller)
    assert [r.getMessage() for r in caplog.records if r.name == rls_door.log.name] == [
        "RLQS stream refused: no valid gateway token, from 127.0.0.1"]


async def test_a_stream_that_never_reads_its_answers_is_not_read_either(rig):
    """A gateway that reports refused buckets and never reads what it is sent: every report is
    answered (200 denials each), and before, the answers queued for it grew with every report
    (1,700 answers after 2,000 reports, none of the client's writes ever held back). Now its
    reports are not read past ``MAX_QUEUED`` answers: the client's own writes are held by flow
    control, and the agent holds a bounded queue."""
    client, ch, _ = rig
    service = client.app.state.agent.gateways.rlqs
    call = rlqs_pb2_grpc.RateLimitQuotaServiceStub(ch).StreamRateLimitQuotas(metadata=META)
    msg = rlqs_pb2.RateLimitQuotaUsageReports(domain="leasehold")
    for i in range(200):
        msg.bucket_quota_usages.add(num_requests_denied=1).bucket_id.bucket.update({"unmapped": f"{i:0>40}"})
    written = 0

    async def write() -> None:
        nonlocal written
        for _ in range(2_000):
            await call.write(msg)
            written += 1

    def full() -> bool:  # the agent holds as many answers as it may: it has stopped reading
        return any(st.queue.qsize() >= rlqs.MAX_QUEUED for st in service.streams.values())

    writer = asyncio.create_task(write())
    try:
        for _ in range(100):  # until the client's writes are held back (or all are written)
            seen = written
            await asyncio.sleep(0.3)
            # (a writer that merely did not run for those 0.3 s, on a loaded machine, is not held back)
            if writer.done() or (written == seen and full()):
                break
        assert not writer.done()  # held back: the agent stopped reading
        (st,) = service.streams.values()
        assert st.queue.qsize() <= rlqs.MAX_QUEUED
        # what was read beyond the queue went into the connection's flow-control windows (grpc's, bounded)
        assert await metric(client, "leasehold_agent_rlqs_reports_total") < written < 2_000
    finally:
        call.cancel()
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)
    # the cancel reaches the agent's end of the stream in a loop turn or two (more on a loaded machine)
    assert await await_until(lambda: not service.streams, within_s=10), service.streams


async def test_rlqs_streams_leave_the_ports_other_slots_to_rls_calls(redis_url: str, policy_file: Path):
    """A stream holds one of ``--rls-max-concurrent-rpcs`` for its whole life: a gateway that opens
    that many streams (at no cost to itself) left none for RLS calls, every one RESOURCE_EXHAUSTED.
    Past ``--rlqs-max-streams`` a stream is refused instead, and RLS calls are answered; each
    refused stream is counted (``leasehold_agent_rlqs_refused_streams_total{reason="exhausted"}``,
    at 0 before the first: LeaseholdRlqsStreamsAtCap)."""
    from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

    from .test_gateways import user

    port = free_port()
    settings = make_settings(redis_url, policy_file, auth_disabled=False, rls_port=port, rls_max_concurrent_rpcs=6,
                             rlqs_max_streams=4, rls_group_linger_ms=0,
                             gateway_tokens=["edge:" + hashlib.sha256(TOKEN.encode()).hexdigest()])
    app = create_app(settings, pepper=PEPPER)
    async with AsyncTestClient(app=app) as client, grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        service = client.app.state.agent.gateways.rlqs
        refusals = "leasehold_agent_rlqs_refused_streams_total"
        assert f'{refusals}{{reason="exhausted"}} 0.0' in (await client.get("/metrics")).text
        opened = [await open_stream(ch) for _ in range(6)]
        try:
            # A stream is counted when it opens, before its first report, and the refusal is sent then.
            # Nothing is written until the refusals are in: grpcio's asyncio client reports INTERNAL,
            # not the server's status, for a write that fails because the server has already ended
            # the stream (a client-side defect; Envoy's client keeps the status).
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while True:  # the refusals reach their pumps within a loop turn or two (more when busy)
                refused = [p for _, p in opened if p.done() and isinstance(p.exception(), grpc.aio.AioRpcError)]
                if len(refused) >= 2 or loop.time() > deadline:
                    break
                await asyncio.sleep(0.05)
            assert len(service.streams) == 4 and len(refused) == 2
            assert {p.exception().code() for p in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert await metric(client, refusals, reason="exhausted") == 2
            assert await metric(client, refusals, reason="not_ready") == 0
            for e, p in opened:
                if not p.done():
                    await e.report(b=(user_bucket("U-streams"), 0, 1))
            assert len(service.streams) == 4
            resp = await rls_pb2_grpc.RateLimitServiceStub(ch).ShouldRateLimit(
                rls_pb2.RateLimitRequest(domain="leasehold", descriptors=[user("U-streams-rls")]), metadata=META,
                timeout=10)
            assert resp.overall_code == resp.OK
        finally:
            for e, p in opened:
                e.call.cancel()
                p.cancel()


async def test_a_policy_change_that_alters_a_buckets_rules_revokes_its_assignment(rig, policy_file: Path):
    client, ch, redis_url = rig
    e, pump = await open_stream(ch)
    try:
        await e.report(b=(user_bucket("U-5"), 0, 1))
        await e.next_actions(2)
        old = northstar()
        rules = [msgspec.structs.replace(r, capacity_millis=4_000) if r.id == "read-user-v3" else r for r in old.rules]
        write_bundle(policy_file, old, bundle_version=old.bundle_version + 1, rules=rules)
        # a request naming a newer bundle version (policyEpoch) makes the agent read its bundle file at once
        probe = await client.post("/v1/admit", json={"requestId": "version-probe-01", "tenantId": "atlas",
                                                     "principal": {"type": "user", "id": "U-9"}, "routeGroup": "read",
                                                     "policyEpoch": old.bundle_version + 1},
                                  headers={"authorization": f"Bearer {TOKEN}"})
        assert probe.status_code == 200 and probe.json()["policyVersion"] == old.bundle_version + 1, probe.text
        acts = await e.next_actions(1, within_s=10)
        assert is_deny(acts[0])  # revoked at once, not at its expiry
        assert await metric(client, "leasehold_agent_rlqs_assignments_total", kind="revoke") >= 1
        await e.report(b=(user_bucket("U-5"), 0, 5))
        deny, tb = await e.next_actions(2, within_s=10)
        assert is_deny(deny) and tokens_of(tb) <= 4  # funded again under the tightened rule
    finally:
        e.call.cancel()
        pump.cancel()


async def test_a_broken_stream_is_a_lease_expiry_its_unused_tokens_stranded(rig):
    client, ch, _ = rig
    e, pump = await open_stream(ch)
    await e.report(b=(user_bucket("U-6"), 0, 1))
    _, tb = await e.next_actions(2)
    n = tokens_of(tb)
    ttl = tb.quota_assignment_action.assignment_time_to_live.seconds
    await e.report(b=(user_bucket("U-6"), 1, 0))  # one used

    async def read_it() -> bool:  # the agent has read that report (counted as it is read) ...
        return await metric(client, "leasehold_agent_rlqs_reports_total") >= 2

    assert await await_until(read_it, within_s=10), "the agent never read the report of the one used"
    e.call.cancel()  # ... before the stream breaks
    pump.cancel()
    await asyncio.sleep(ttl)  # the assignment has expired in the Envoy (the agent strands it at its next tick)

    async def stranded() -> bool:
        return await metric(client, "leasehold_agent_rlqs_stranded_tokens_total") == n - 1

    assert await await_until(stranded, within_s=10), await metric(client, "leasehold_agent_rlqs_stranded_tokens_total")
    assert await metric(client, "leasehold_agent_rlqs_streams") == 0


async def test_an_agent_without_the_rls_port_serves_no_assignments(redis_url: str, policy_file: Path):
    settings = make_settings(redis_url, policy_file, auth_disabled=False,
                             operator_tokens=["ops:" + hashlib.sha256(OPS.encode()).hexdigest()])
    async with AsyncTestClient(app=create_app(settings, pepper=PEPPER)) as client:
        r = await client.get("/v1/rlqs", headers={"authorization": f"Bearer {OPS}"})
        assert r.status_code == 200 and r.json() == {"region": "eu", "serving": False, "streams": [], "buckets": []}
        assert (await client.get("/v1/rlqs")).status_code == 401
