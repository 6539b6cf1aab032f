"""Batcher coalescing, local fallback bounds, chunk leases, settings (no network)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kernel.bundle import Fallback, Rule
from kernel.config import ConfigError
from kernel.errors import DeadlineExceeded, Overloaded, StoreUnavailable
from region_agent.chunks import ChunkLease
from region_agent.fallback import LocalFallback, LocalItem
from region_agent.settings import AgentSettings, load_agent_settings, resolve_pepper
from region_agent.store.batcher import Batcher
from region_agent.store.client import is_cluster_url, plain_url, redacted

READ = Rule(id="read-user-v3", scope="user", route_group="read", algorithm="token_bucket", capacity_millis=20_000,
            refill_millis=2_000, period_ms=1_000, cost_millis=1_000, fail_mode="local_bounded",
            fallback=Fallback(capacity_millis=5_000, refill_millis=250, period_ms=1_000))
ANON = Rule(id="anon-login", scope="ip", route_group="login", algorithm="fixed_window", limit=20, window_ms=10_000,
            fail_mode="local_bounded", fallback=Fallback(limit=5, window_ms=10_000))


# --- batcher -----------------------------------------------------------------------------------
async def test_concurrent_submits_share_one_pipeline_and_keep_order():
    sent: list[list] = []

    async def run(calls):
        sent.append(list(calls))
        await asyncio.sleep(0)
        return [f"reply:{c[1][0]}" for c in calls]

    b = Batcher(run, max_batch=100)
    results = await asyncio.gather(*(b.submit([("s", [f"k{i}"], []), ("s", [f"k{i}b"], [])]) for i in range(10)))
    assert results == [[f"reply:k{i}", f"reply:k{i}b"] for i in range(10)]
    assert len(sent) == 1 and len(sent[0]) == 20


async def test_next_flush_starts_when_the_previous_one_finished():
    sent: list[int] = []
    gate = asyncio.Event()

    async def run(calls):
        sent.append(len(calls))
        if len(sent) == 1:
            await gate.wait()
        return [None] * len(calls)

    b = Batcher(run, max_batch=100, max_inflight=1)
    first = asyncio.create_task(b.submit([("s", ["a"], [])]))
    await asyncio.sleep(0.01)
    rest = [asyncio.create_task(b.submit([("s", [f"k{i}"], [])])) for i in range(5)]
    await asyncio.sleep(0.01)
    assert sent == [1]  # the five wait for the in-flight pipeline
    gate.set()
    await asyncio.gather(first, *rest)
    assert sent == [1, 5]


async def test_pipelines_in_flight_are_bounded():
    sent: list[int] = []
    gates = [asyncio.Event(), asyncio.Event()]

    async def run(calls):
        sent.append(len(calls))
        if len(sent) <= 2:
            await gates[len(sent) - 1].wait()
        return [None] * len(calls)

    b = Batcher(run, max_batch=3, max_inflight=2)
    first = asyncio.create_task(b.submit([("s", ["a"], [])]))
    await asyncio.sleep(0.01)
    second = [asyncio.create_task(b.submit([("s", [f"k{i}"], [])])) for i in range(2)]
    await asyncio.sleep(0.01)
    assert sent == [1, 2]  # a second pipeline goes while the first is in flight
    third = [asyncio.create_task(b.submit([("s", [f"m{i}"], [])])) for i in range(4)]
    await asyncio.sleep(0.01)
    assert sent == [1, 2]  # both drain tasks busy: the rest waits
    gates[1].set()
    await asyncio.gather(*second)
    await asyncio.sleep(0.01)
    assert sent == [1, 2, 3, 1]  # in batches of at most max_batch
    gates[0].set()
    await asyncio.gather(first, *third)


async def test_bounded_queue_refuses_without_sending_and_deadline_before_send():
    gate = asyncio.Event()

    async def run(calls):
        await gate.wait()
        return [None] * len(calls)

    b = Batcher(run, max_batch=1, max_queue=2, max_inflight=1)
    t1 = asyncio.create_task(b.submit([("s", ["a"], [])]))
    await asyncio.sleep(0.01)  # in flight
    t2 = asyncio.create_task(b.submit([("s", ["b"], [])]))
    t3 = asyncio.create_task(b.submit([("s", ["c"], [])]))
    await asyncio.sleep(0.01)
    with pytest.raises(Overloaded):  # a full queue is this agent's overload, not a store failure
        await b.submit([("s", ["d"], [])])
    gate.set()
    await asyncio.gather(t1, t2, t3)


async def test_deadline_while_still_queued_means_never_sent():
    gate = asyncio.Event()
    sent: list[str] = []

    async def run(calls):
        sent.extend(c[1][0] for c in calls)
        await gate.wait()
        return [None] * len(calls)

    b = Batcher(run, max_inflight=1)
    first = asyncio.create_task(b.submit([("s", ["a"], [])]))
    await asyncio.sleep(0.01)
    with pytest.raises(DeadlineExceeded):
        await b.submit([("s", ["late"], [])], wait_s=0.01)
    gate.set()
    await first
    await asyncio.sleep(0.01)
    assert sent == ["a"] and b.queued == 0


async def test_a_failed_pipeline_fails_every_caller():
    async def run(calls):
        raise StoreUnavailable("down")

    b = Batcher(run, max_inflight=1)
    res = await asyncio.gather(b.submit([("s", ["a"], [])]), b.submit([("s", ["b"], [])]), return_exceptions=True)
    assert all(isinstance(r, StoreUnavailable) for r in res)


# --- local fallback ----------------------------------------------------------------------------
def test_local_bucket_is_bounded_by_its_capacity_and_refill():
    fb = LocalFallback(max_keys=10)
    item = [LocalItem("k", READ, 1)]
    assert [fb.admit(item, 1_000).allowed for _ in range(6)] == [True] * 5 + [False]
    denied = fb.admit(item, 1_000)
    assert denied.retry_after_ms == 4_000 and denied.denied_by == 1
    assert fb.admit(item, 5_000).allowed and not fb.admit(item, 5_000).allowed  # 0.25/s: one token per 4 s


def test_local_window_and_all_or_nothing():
    fb = LocalFallback()
    both = [LocalItem("ip", ANON, 1), LocalItem("u", READ, 1)]
    assert all(fb.admit(both, 1_000).allowed for _ in range(5))
    r = fb.admit(both, 1_000)
    assert not r.allowed and r.denied_by == 1 and r.retry_after_ms == 9_000
    # the window denied, so the bucket was not debited: a bucket-only request still has no tokens left (5 used)
    assert not fb.admit([LocalItem("u", READ, 1)], 1_000).allowed


def test_local_state_is_bounded():
    fb = LocalFallback(max_keys=3)
    for i in range(10):
        fb.admit([LocalItem(f"k{i}", READ, 1)], 1_000)
    assert len(fb) == 3


# --- chunk leases ------------------------------------------------------------------------------
def test_chunk_lease_spend_give_back_expiry():
    lease = ChunkLease()
    assert lease.try_take(1, 0) is None
    lease.grant(100, now_ms=0, validity_ms=250)
    gen = lease.try_take(1, 10)
    assert gen is not None and lease.remaining == 99
    assert lease.give_back(1, gen, 20) and lease.remaining == 100
    assert lease.try_take(1, 250) is None  # expired: unspent tokens abandoned
    lease.grant(10, now_ms=300, validity_ms=250)
    assert not lease.give_back(1, gen, 310)  # a reservation from an older chunk does not land here
    assert lease.deny(400, 1_000, 250) == 250 and lease.negative(500) and not lease.negative(650)


# --- settings ----------------------------------------------------------------------------------
def test_settings_flags_env_and_pepper(tmp_path: Path):
    s = load_agent_settings(["--redis-url", "redis+cluster://127.0.0.1:7000", "--port", "9000"],
                            env={"LEASEHOLD_AGENT_REGION": "eu"})
    assert (s.port, s.region, s.redis_url) == (9000, "eu", "redis+cluster://127.0.0.1:7000")
    with pytest.raises(ConfigError):
        load_agent_settings(["--port", "70000"], env={})
    with pytest.raises(ConfigError):
        resolve_pepper(AgentSettings(), env={})
    assert resolve_pepper(AgentSettings(), env={"LEASEHOLD_AGENT_PEPPER": "s3cret"}) == b"s3cret"
    f = tmp_path / "pepper"
    f.write_text("from-file\n")
    assert resolve_pepper(AgentSettings(pepper_file=str(f)), env={}) == b"from-file"
    assert resolve_pepper(AgentSettings(insecure_dev_pepper=True), env={})


def test_cluster_urls():
    assert is_cluster_url("redis+cluster://h:1") and not is_cluster_url("redis://h:1")
    assert plain_url("rediss+cluster://h:1/0") == "rediss://h:1/0"
    assert redacted("redis://user:pw@h:1/0") == "redis://h:1/0"


def test_bare_boolean_flags():
    from region_agent.__main__ import normalize_argv

    assert normalize_argv(["--insecure-dev-pepper", "--port", "1"]) == ["--insecure-dev-pepper", "true", "--port", "1"]
    assert normalize_argv(["--redis-cluster"]) == ["--redis-cluster", "true"]
    assert normalize_argv(["--redis-cluster", "false"]) == ["--redis-cluster", "false"]
