"""Policy distribution through etcd (docs/invariants.md I13) on the real etcd and Redis fixtures:
publish with a compare in the transaction, agents following the key, refusals counted,
last good bundle kept, maxAgeMs revocation, shadow rules and a mid-run tightening."""

from __future__ import annotations

import asyncio
import signal
import uuid
from pathlib import Path

import msgspec
import pytest
from litestar.testing import AsyncTestClient

from kernel.bundle import Bundle, Rule, encode_bundle, make_rule, seal
from kernel.errors import Conflict, PolicyError, StaleVersion
from kernel.etcd_store import EtcdStore, TxnBuilder
from kernel.policy_store import PolicyStore, Stored, policy_key
from leasehold.commands.cli import main as cli_main
from leasehold.local.procs import free_port
from region_agent.service.app import create_app
from tests.support.agent import PEPPER, admit_body, make_settings
from tests.support.policies import northstar, write_bundle
from tests.support.waiting import await_until


def bump(b: Bundle, version: int, **changes) -> Bundle:
    return seal(msgspec.structs.replace(b, bundle_version=version, **changes))


def with_rule(b: Bundle, rule_id: str, **changes) -> list[Rule]:
    return [msgspec.structs.replace(r, **changes) if r.id == rule_id else r for r in b.rules]


@pytest.fixture
def prefix() -> str:
    return f"/lh-{uuid.uuid4().hex[:8]}/"


@pytest.fixture
async def pstore(etcd_cluster, prefix):
    store = PolicyStore(EtcdStore(",".join(etcd_cluster.endpoints)), prefix)
    yield store
    await store.store.close()


# -- publish ------------------------------------------------------------------------------------
async def test_publish_only_strictly_higher_versions(pstore):
    base = northstar()
    assert await pstore.read() is None
    first = await pstore.publish(encode_bundle(bump(base, 10)))
    assert (first.version, first.previous) == (10, None)
    with pytest.raises(StaleVersion):
        await pstore.publish(encode_bundle(bump(base, 10)))
    with pytest.raises(StaleVersion):
        await pstore.publish(encode_bundle(bump(base, 9)))
    corrupt = encode_bundle(bump(base, 11)).replace(b'"capacityMillis": 20000', b'"capacityMillis": 20001')
    with pytest.raises(PolicyError):  # checksum no longer matches the content
        await pstore.publish(corrupt)
    stored = await pstore.read()
    assert stored is not None and stored.bundle is not None and stored.bundle.bundle_version == 10
    second = await pstore.publish(encode_bundle(bump(base, 11)))
    assert (second.version, second.previous) == (11, 10) and second.revision > first.revision


async def test_the_compare_is_inside_the_transaction(pstore):
    """A publish that read the key before someone else wrote it fails instead of overwriting."""
    base = northstar()
    await pstore.publish(encode_bundle(bump(base, 20)))
    seen = await pstore.read()
    await pstore.publish(encode_bundle(bump(base, 30)))  # a concurrent publisher wins

    class ReadBeforeTheOtherWrite(PolicyStore):
        async def read(self) -> Stored | None:
            return seen

    late = ReadBeforeTheOtherWrite(pstore.store, pstore.key.decode().removesuffix("policy/current"))
    with pytest.raises(Conflict):
        await late.publish(encode_bundle(bump(base, 25)))
    stored = await pstore.read()
    assert stored.bundle.bundle_version == 30


def test_cli_publish_show_and_rollback(etcd_cluster, prefix, tmp_path: Path, capsys):
    base = northstar()
    ep = ",".join(etcd_cluster.endpoints)
    v5 = tmp_path / "v5.json"
    v5.write_bytes(encode_bundle(bump(base, 5)))
    v6 = tmp_path / "v6.json"
    v6.write_bytes(encode_bundle(bump(base, 6, rules=with_rule(base, "read-user-v3", capacity_millis=5000))))
    capsys.readouterr()
    assert cli_main(["policy", "publish", str(v5), "--etcd", ep, "--prefix", prefix]) == 0
    said = capsys.readouterr().out  # was "(previous None)"
    assert said.startswith(f"published bundle 5 (the first) at {prefix}policy/current, revision "), said
    assert cli_main(["policy", "publish", str(v6), "--etcd", ep, "--prefix", prefix]) == 0
    assert capsys.readouterr().out.startswith(f"published bundle 6 (previous 5) at {prefix}policy/current")
    # checked against what is published: said not to be publishable as is (was silent until publish refused it)
    assert cli_main(["policy", "validate", str(v5), "--against-etcd", "--etcd", ep, "--prefix", prefix]) == 0
    assert "\nnot publishable as is: bundle 5 is not above the published 6 (" in capsys.readouterr().out
    assert cli_main(["policy", "show", "--etcd", ep, "--prefix", prefix]) == 0
    said = capsys.readouterr().out  # the sample has no maxAge: was "max age None ms"
    assert f"\n  published at {bump(base, 6).published_at}, no max age, unsigned\n" in said, said
    capsys.readouterr()
    assert cli_main(["policy", "publish", str(v5), "--etcd", ep, "--prefix", prefix]) == 3  # not higher
    # the second of two operators who bumped the same version: told that bumping alone would lose the first's edit
    said = capsys.readouterr().err
    assert said.startswith("leasehold: not published (stale-version): bundle 5 is not newer than the published 6\n")
    assert f"`leasehold policy diff published.json {v5}`, carry them over" in said, said
    bad = tmp_path / "bad.json"
    bad.write_text('{"bundleVersion": 99}')
    assert cli_main(["policy", "publish", str(bad), "--etcd", ep, "--prefix", prefix]) == 2
    # rollback: v5's content under version 7
    assert cli_main(["policy", "publish", str(v5), "--as-version", "7", "--etcd", ep, "--prefix", prefix]) == 0
    capsys.readouterr()
    assert cli_main(["policy", "show", "--etcd", ep, "--prefix", prefix, "-o", "json"]) == 0
    shown = msgspec.json.decode(capsys.readouterr().out)
    assert shown["bundleVersion"] == 7 and shown["valid"] and shown["key"] == prefix + "policy/current"
    assert shown["checksum"] == bump(base, 7).checksum  # same content as v5, re-sealed


# -- agents follow the key ------------------------------------------------------------------------
def agent_app(redis_url: str, policy_file: Path, etcd_cluster, prefix: str, **kw):
    settings = make_settings(redis_url, policy_file, policy_etcd=",".join(etcd_cluster.endpoints),
                             policy_etcd_prefix=prefix, policy_etcd_reread_ms=kw.pop("reread_ms", 200), **kw)
    return create_app(settings, pepper=PEPPER)


def reload_count(metrics: str, outcome: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(f'leasehold_agent_policy_reloads_total{{outcome="{outcome}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_agent_switches_refuses_and_keeps_the_last_good(redis_url, policy_file, etcd_cluster, prefix, pstore):
    base = northstar()
    async with AsyncTestClient(app=agent_app(redis_url, policy_file, etcd_cluster, prefix)) as agent:
        d = (await agent.post("/v1/admit", json=admit_body("req-00000001"))).json()
        assert d["policyVersion"] == base.bundle_version
        await pstore.publish(encode_bundle(bump(base, base.bundle_version + 1)))

        async def switched() -> bool:
            return (await agent.get("/v1/policy")).json()["bundleVersion"] == base.bundle_version + 1
        assert await await_until(switched, within_s=10)
        d = (await agent.post("/v1/admit", json=admit_body("req-00000002"))).json()
        assert d["allowed"] and d["policyVersion"] == base.bundle_version + 1

        # a corrupt value written straight to etcd (bypassing publish): refused, counted, old kept
        corrupt = encode_bundle(bump(base, base.bundle_version + 5)).replace(b"20000", b"20001", 1)
        await pstore.store.put(pstore.key, corrupt)

        async def refused_invalid() -> bool:
            return reload_count((await agent.get("/metrics")).text, "invalid") >= 1
        assert await await_until(refused_invalid, within_s=10)
        # a lower version written straight to etcd: refused as stale
        await pstore.store.put(pstore.key, encode_bundle(bump(base, 1)))

        async def refused_stale() -> bool:
            return reload_count((await agent.get("/metrics")).text, "stale") >= 1
        assert await await_until(refused_stale, within_s=10)
        d = (await agent.post("/v1/admit", json=admit_body("req-00000003"))).json()
        assert d["allowed"] and d["policyVersion"] == base.bundle_version + 1
        assert (await agent.get("/v1/policy")).json()["bundleVersion"] == base.bundle_version + 1


async def test_tightening_applies_on_the_next_request(redis_url, policy_file, etcd_cluster, prefix, pstore):
    """Limits ride as script arguments and stored tokens are clamped to the capacity in force."""
    base = northstar()
    async with AsyncTestClient(app=agent_app(redis_url, policy_file, etcd_cluster, prefix)) as agent:
        first = (await agent.post("/v1/admit", json=admit_body("tight-0001"))).json()
        assert first["allowed"] and first["limit"] == 20 and first["remaining"] == 19
        tight = bump(base, base.bundle_version + 1,
                     rules=with_rule(base, "read-user-v3", capacity_millis=3000, refill_millis=1, period_ms=60_000))
        await pstore.publish(encode_bundle(tight))

        async def switched() -> bool:
            return (await agent.get("/v1/policy")).json()["bundleVersion"] == tight.bundle_version
        assert await await_until(switched, within_s=10)
        ds = [(await agent.post("/v1/admit", json=admit_body(f"tight-{i:04d}"))).json() for i in range(2, 7)]
        assert ds[0]["policyVersion"] == tight.bundle_version and ds[0]["limit"] == 3
        assert ds[0]["remaining"] == 2  # 19 stored tokens clamped to 3, then one spent
        assert [d["allowed"] for d in ds] == [True, True, True, False, False]


async def test_shadow_rule_published_mid_run_is_counted_never_enforced(redis_url, policy_file, etcd_cluster,
                                                                        prefix, pstore):
    base = northstar()
    shadow = make_rule(id="shadow-read-1", scope="route", route_group="read", algorithm="fixed_window", limit=1,
                  window_ms=60_000, fail_mode="open", shadow=True)
    async with AsyncTestClient(app=agent_app(redis_url, policy_file, etcd_cluster, prefix)) as agent:
        await pstore.publish(encode_bundle(bump(base, base.bundle_version + 1, rules=[*base.rules, shadow])))

        async def switched() -> bool:
            return (await agent.get("/v1/policy")).json()["bundleVersion"] == base.bundle_version + 1
        assert await await_until(switched, within_s=10)
        ds = [(await agent.post("/v1/admit", json=admit_body(f"shadow-{i:04d}"))).json() for i in range(4)]
        assert all(d["allowed"] and d["policyId"] == "read-user-v3" for d in ds)
        text = (await agent.get("/metrics")).text
        assert 'leasehold_agent_shadow_decisions_total{outcome="allowed",rule="shadow-read-1"} 1.0' in text
        assert 'leasehold_agent_shadow_decisions_total{outcome="denied",rule="shadow-read-1"} 3.0' in text


# -- maxAgeMs (I13) -----------------------------------------------------------------------------
async def test_revocable_rules_deny_once_the_snapshot_is_too_old(redis_url, policy_file: Path, tmp_path, prefix):
    base = northstar()
    write_bundle(policy_file, base, max_age_ms=300,
                 rules=with_rule(base, "tenant-atlas-minute", revocable=True))
    dead = f"127.0.0.1:{free_port()}"  # nothing listens: etcd unreachable from the start
    settings = make_settings(redis_url, policy_file, policy_etcd=dead, policy_etcd_prefix=prefix,
                             policy_etcd_reread_ms=100)
    app = create_app(settings, pepper=PEPPER)
    async with AsyncTestClient(app=app) as agent:
        watcher = app.state.agent.policy_watch

        async def stale() -> bool:
            return watcher.is_stale(app.state.agent.holder.bundle)
        assert await await_until(stale, within_s=10)
        atlas = await agent.post("/v1/admit", json=admit_body("stale-0001", tenant="atlas"))
        body = atlas.json()
        assert not body["allowed"] and body["reason"] == "POLICY_STALE" and body["httpStatus"] == 503
        assert body["policyId"] == "tenant-atlas-minute" and body["headers"]["Retry-After"] == "5"
        birch = (await agent.post("/v1/admit", json=admit_body("stale-0002", tenant="birch"))).json()
        assert birch["allowed"] and birch["policyVersion"] == base.bundle_version  # last good bundle served
        batch = (await agent.post("/v1/admit/batch", json={"requests": [
            admit_body("stale-0003", tenant="birch"), admit_body("stale-0004", tenant="atlas")]})).json()
        assert [d["reason"] for d in batch["decisions"]] == [None, "POLICY_STALE"]
        assert "leasehold_agent_policy_age_seconds" in (await agent.get("/metrics")).text


async def test_fresh_reads_keep_revocable_rules_enforced_normally(redis_url, policy_file, etcd_cluster, prefix):
    base = northstar()
    write_bundle(policy_file, base, max_age_ms=60_000,
                 rules=with_rule(base, "tenant-atlas-minute", revocable=True))
    app = agent_app(redis_url, policy_file, etcd_cluster, prefix, reread_ms=100)
    async with AsyncTestClient(app=app) as agent:
        watcher = app.state.agent.policy_watch

        async def read_twice() -> bool:
            return watcher.reads_ok >= 2
        assert await await_until(read_twice, within_s=10)
        d = (await agent.post("/v1/admit", json=admit_body("fresh-0001", tenant="atlas"))).json()
        assert d["allowed"] and d["reason"] is None


def test_policy_key_layout():
    assert policy_key("/leasehold/") == b"/leasehold/policy/current"


async def test_etcd_lost_after_a_publish_keeps_it_then_revokes(redis_url, policy_file, tmp_path, prefix):
    """Publish v+1 (maxAgeMs 1.5 s, Atlas's rule revocable), the agent follows; etcd dies: v+1 keeps
    serving, and once the snapshot is older than maxAgeMs only the revocable rule turns to 503."""
    from leasehold.local.procs import EtcdCluster

    base = northstar()
    cluster = EtcdCluster(tmp_path / "etcd-1", members=1).start()
    store = PolicyStore(EtcdStore(",".join(cluster.endpoints), timeout_s=0.5), prefix)
    try:
        app = agent_app(redis_url, policy_file, cluster, prefix, reread_ms=100)
        async with AsyncTestClient(app=app) as agent:
            newer = bump(base, base.bundle_version + 1, max_age_ms=1_500,
                         rules=with_rule(base, "tenant-atlas-minute", revocable=True))
            await store.publish(encode_bundle(newer))

            async def switched() -> bool:
                return app.state.agent.holder.bundle.bundle_version == newer.bundle_version
            assert await await_until(switched, within_s=10)
            d = (await agent.post("/v1/admit", json=admit_body("lost-0001", tenant="atlas"))).json()
            assert d["allowed"] and d["policyVersion"] == newer.bundle_version
            cluster.stop()
            watcher = app.state.agent.policy_watch

            async def stale() -> bool:
                return watcher.is_stale(app.state.agent.holder.bundle)
            assert await await_until(stale, within_s=30)
            atlas = (await agent.post("/v1/admit", json=admit_body("lost-0002", tenant="atlas"))).json()
            birch = (await agent.post("/v1/admit", json=admit_body("lost-0003", tenant="birch"))).json()
            assert atlas["reason"] == "POLICY_STALE" and atlas["httpStatus"] == 503
            assert birch["allowed"] and birch["policyVersion"] == newer.bundle_version  # last good bundle
            assert watcher.reads_failed > 0
    finally:
        await store.store.close()
        cluster.stop()


async def test_the_watch_alone_delivers_a_publish(redis_url, policy_file, etcd_cluster, prefix, pstore):
    """With the safety-net re-read set to 10 minutes, only the etcd watch can bring the switch."""
    base = northstar()
    app = agent_app(redis_url, policy_file, etcd_cluster, prefix, reread_ms=600_000)
    async with AsyncTestClient(app=app) as agent:
        watcher = app.state.agent.policy_watch
        await asyncio.sleep(0.3)  # let the watch register
        reads_before = watcher.reads_ok
        await pstore.publish(encode_bundle(bump(base, base.bundle_version + 3)))

        async def switched() -> bool:
            return (await agent.get("/v1/policy")).json()["bundleVersion"] == base.bundle_version + 3
        assert await await_until(switched, within_s=15)
        assert watcher.reads_ok > reads_before


async def test_a_watch_on_a_lost_member_moves_with_the_reads(redis_url, policy_file, fresh_etcd_cluster, prefix):
    """The member the agent's watch is on stops answering (SIGSTOP: a hung host; nothing arrives,
    no error either): the next re-read times out on it and goes on to a live member, whose link
    replaces the lost one's — closing it ends the watch, which is created again on the live
    member, so the next publish is delivered by the watch, not only by the next re-read."""
    cluster, base = fresh_etcd_cluster, northstar()
    app = agent_app(redis_url, policy_file, cluster, prefix, reread_ms=3_000)
    async with AsyncTestClient(app=app) as agent:
        watcher = app.state.agent.policy_watch

        def version(v: int):
            async def seen() -> bool:
                return (await agent.get("/v1/policy")).json()["bundleVersion"] == v
            return seen

        await asyncio.sleep(0.5)  # the watch is created on the endpoint in use
        lost = cluster.endpoints.index(watcher.store.store._current().name)
        live = ",".join(e for i, e in enumerate(cluster.endpoints) if i != lost)
        pub = PolicyStore(EtcdStore(live), prefix)
        cluster.procs[lost].signal(signal.SIGSTOP)
        try:
            await pub.publish(encode_bundle(bump(base, base.bundle_version + 1)))
            assert await await_until(version(base.bundle_version + 1), within_s=10)  # the re-read
            await asyncio.sleep(0.5)
            events = watcher.watch_events
            await pub.publish(encode_bundle(bump(base, base.bundle_version + 2)))
            assert await await_until(version(base.bundle_version + 2), within_s=10)

            async def the_watch_told() -> bool:  # the watch, on the live member, not only the next re-read
                return watcher.watch_events > events
            assert await await_until(the_watch_told, within_s=10), "the watch did not move to a live member"
        finally:
            cluster.procs[lost].signal(signal.SIGCONT)
            await pub.store.close()


async def test_a_compaction_past_the_watchs_start_does_not_end_it(redis_url, policy_file, etcd_cluster, prefix,
                                                                 pstore):
    """The watch starts at "now" (no start revision): etcd compacting its history to the current
    revision cancels no watch of the agent, and the next publish is still delivered by it (the
    re-read set to 10 minutes)."""
    base = northstar()
    app = agent_app(redis_url, policy_file, etcd_cluster, prefix, reread_ms=600_000)
    async with AsyncTestClient(app=app) as agent:
        await asyncio.sleep(0.3)  # let the watch register
        first = await pstore.publish(encode_bundle(bump(base, base.bundle_version + 1)))
        await asyncio.to_thread(etcd_cluster.etcdctl, "compact", str(first.revision))

        def version(v: int):
            async def seen() -> bool:
                return (await agent.get("/v1/policy")).json()["bundleVersion"] == v
            return seen
        assert await await_until(version(base.bundle_version + 1), within_s=10)
        await pstore.publish(encode_bundle(bump(base, base.bundle_version + 2)))
        assert await await_until(version(base.bundle_version + 2), within_s=10)


async def test_the_watch_comes_back_after_every_member_restarted(redis_url, policy_file, fresh_etcd_cluster, prefix):
    """Every member stopped for a few seconds, then started: the watch is created again within the
    re-read period (its back-off is bounded by it) and delivers the next publish by itself."""
    cluster, base = fresh_etcd_cluster, northstar()
    app = agent_app(redis_url, policy_file, cluster, prefix, reread_ms=2_000)
    async with AsyncTestClient(app=app) as agent:
        def version(v: int):
            async def seen() -> bool:
                return (await agent.get("/v1/policy")).json()["bundleVersion"] == v
            return seen

        await asyncio.sleep(0.5)
        for i in range(len(cluster.procs)):
            await asyncio.to_thread(cluster.stop_member, i)
        await asyncio.sleep(3.0)
        await asyncio.gather(*(asyncio.to_thread(cluster.start_member, i) for i in range(len(cluster.procs))))
        # the members elect a leader before the publish can be written (a loaded machine: seconds)
        await asyncio.to_thread(cluster.wait_healthy)
        pub = PolicyStore(EtcdStore(",".join(cluster.endpoints)), prefix)
        try:
            await pub.publish(encode_bundle(bump(base, base.bundle_version + 1)))
            assert await await_until(version(base.bundle_version + 1), within_s=15)
            await asyncio.sleep(2.5)  # a re-read period: the watch is back by now
            watcher = app.state.agent.policy_watch
            events = watcher.watch_events
            await pub.publish(encode_bundle(bump(base, base.bundle_version + 2)))
            assert await await_until(version(base.bundle_version + 2), within_s=10)

            async def the_watch_told() -> bool:  # not only a re-read: the watch delivered the publish's event
                return watcher.watch_events > events
            assert await await_until(the_watch_told, within_s=10), "the watch did not come back"
        finally:
            await pub.store.close()


async def test_a_value_nested_too_deeply_is_refused_and_a_publish_replaces_it(redis_url, policy_file, etcd_cluster,
                                                                              prefix, pstore, capsys):
    """A few kilobytes of brackets under the policy and canary keys (written straight to etcd): the agent
    counts the value invalid and keeps reading etcd (its age stays fresh, so revocable rules are not
    revoked by it), and ``policy show`` and ``publish`` name it and replace it. Was a RecursionError out
    of the decode: the agent's reads stopped counting (its age grew with every re-read), the refusal was
    never counted, and every ``policy`` command against that etcd exited 70."""
    base = northstar()
    deep = b"[" * 5000 + b"]" * 5000
    ep = ",".join(etcd_cluster.endpoints)
    app = agent_app(redis_url, policy_file, etcd_cluster, prefix, reread_ms=100)
    async with AsyncTestClient(app=app) as agent:
        watcher = app.state.agent.policy_watch
        await pstore.store.put(pstore.key, deep)
        await pstore.store.put(pstore.canary_key, b'{"base": 1, "slice": {"regions": ["eu"]}, "bundle": ' + deep + b"}")

        async def refused_invalid() -> bool:
            return reload_count((await agent.get("/metrics")).text, "invalid") >= 1
        assert await await_until(refused_invalid, within_s=10)
        reads = watcher.reads_ok

        async def still_reading() -> bool:
            return watcher.reads_ok >= reads + 2
        assert await await_until(still_reading, within_s=10)
        assert (await agent.get("/v1/policy")).json()["bundleVersion"] == base.bundle_version

        capsys.readouterr()
        # exit 2: what is published is not what the agents run (was 0, the code of a healthy fleet)
        assert await asyncio.to_thread(cli_main, ["policy", "show", "--etcd", ep, "--prefix", prefix]) == 2
        shown = capsys.readouterr().out
        assert "INVALID: bundle is not valid JSON: nested too deeply" in shown, shown
        gone = TxnBuilder()
        gone.delete(pstore.canary_key)
        await pstore.store.commit(gone)
        nxt = policy_file.parent / "next.json"
        nxt.write_bytes(encode_bundle(bump(base, base.bundle_version + 1)))
        # was "nothing is published yet": something is, and it is not a bundle
        assert await asyncio.to_thread(cli_main, ["policy", "canary", str(nxt), "--regions", "eu", "--etcd", ep,
                                                  "--prefix", prefix]) == 2
        assert "the published value is not a valid bundle (bundle is not valid JSON: nested too deeply" \
            in capsys.readouterr().err
        assert await asyncio.to_thread(cli_main, ["policy", "publish", str(nxt), "--etcd", ep, "--prefix", prefix]) == 0
        said = capsys.readouterr().out  # was "(the first)"
        assert f"published bundle {base.bundle_version + 1} (over an invalid value: bundle is not valid JSON: nested " \
               "too deeply" in said, said
        for verb in ("promote", "rollback"):  # was "invalid: no canary is staged": no bundle was
            assert await asyncio.to_thread(cli_main, ["policy", verb, "--etcd", ep, "--prefix", prefix]) == 2
            assert capsys.readouterr().err.startswith("leasehold: not done: no canary is staged")

        async def switched() -> bool:
            return (await agent.get("/v1/policy")).json()["bundleVersion"] == base.bundle_version + 1
        assert await await_until(switched, within_s=10)


async def test_promote_never_takes_back_a_publish_made_after_the_canary_was_staged(pstore):
    """Operator A stages a candidate; operator B publishes an edit directly. Promoting A's candidate
    would write content without B's edit (or a lower version than the agents hold): refused, nothing
    written, the canary still staged; a rollback ends it on top of B's edit. Was: ``promoted: bundle 12
    is published to every agent (was 13)``, the key left at 12 while every agent kept 13."""
    from kernel.policy_store import Slice

    base = northstar()
    await pstore.publish(encode_bundle(bump(base, 10)))
    eu = Slice(regions=["eu"])
    await pstore.stage(encode_bundle(bump(base, 12, rules=with_rule(base, "read-user-v3", capacity_millis=5000))), eu)
    edit = bump(base, 11, rules=with_rule(base, "read-user-v3", refill_millis=1000))
    await pstore.publish(encode_bundle(edit))  # below the candidate: B's edit, not in the candidate
    with pytest.raises(Conflict, match="published after the candidate 12 was staged over 10"):
        await pstore.promote()
    newer = bump(base, 13, rules=with_rule(base, "read-user-v3", refill_millis=500))
    await pstore.publish(encode_bundle(newer))  # above the candidate
    with pytest.raises(StaleVersion, match="the candidate is not newer"):
        await pstore.promote()
    stored, staged = await pstore.read_both()
    assert stored.bundle == newer and staged is not None and staged.bundle.bundle_version == 12
    back = await pstore.rollback(encode_bundle(bump(newer, 14)))
    stored, staged = await pstore.read_both()
    assert back.version == 14 and staged is None and stored.bundle.rules == newer.rules
    # staged over what is published, a promote is what it always was
    await pstore.stage(encode_bundle(bump(base, 15)), eu)
    assert (await pstore.promote()).version == 15


async def test_a_canary_is_signed_by_a_key_the_fleet_requires_as_a_publish_is(pstore):
    """With the signing marker in etcd, ``publish`` refused a bundle no trusted key verifies, but ``canary``
    staged one (every agent of the slice then refused it: exit 0 and "staged" for a canary nobody ran),
    ``promote`` published it to every agent (each refused it, etcd left holding it) and ``rollback``
    published an unsigned one. Each now refuses it as publish does and writes nothing."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from kernel.policy_store import SigningMarker, Slice
    from kernel.signing import SignatureRefused, key_id_of, public_key_text, sign_bundle

    trusted, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    base = northstar()
    await pstore.publish(encode_bundle(sign_bundle(bump(base, 10), trusted)))
    await pstore.write_signing(SigningMarker(keys={key_id_of(trusted.public_key()):
                                                   public_key_text(trusted.public_key())}))
    eu = Slice(regions=["eu"])
    with pytest.raises(SignatureRefused, match="not trusted") as refused:
        await pstore.stage(encode_bundle(sign_bundle(bump(base, 11), other)), eu)
    assert any("the fleet requires bundles signed by one of" in p for p in refused.value.further)
    with pytest.raises(SignatureRefused, match="unsigned"):
        await pstore.stage(encode_bundle(bump(base, 11)), eu)
    assert (await pstore.read_both())[1] is None
    # a candidate in the canary key that no trusted key verifies (written by hand, or staged before the marker)
    foreign = sign_bundle(bump(base, 11), other)
    await pstore.store.put(pstore.canary_key, b'{"base": 10, "slice": {"regions": ["eu"]}, "bundle": %s}'
                           % encode_bundle(foreign))
    with pytest.raises(SignatureRefused, match="not trusted"):
        await pstore.promote()
    with pytest.raises(SignatureRefused, match="unsigned"):
        await pstore.rollback(encode_bundle(bump(base, 12)))
    stored, staged = await pstore.read_both()
    assert stored.bundle.bundle_version == 10 and staged is not None
    assert (await pstore.rollback(encode_bundle(sign_bundle(bump(base, 12), trusted)))).version == 12


def test_publish_beside_a_staged_canary_says_what_becomes_of_it(etcd_cluster, prefix, tmp_path: Path, capsys):
    """A direct publish while a canary is staged: published, and one note on stderr saying that the slice
    keeps the candidate (or drops it) and that promote now refuses. Was silent: the operator learnt it from
    a promote that took the publish back (or, now, from the promote's refusal)."""
    base = northstar()
    ep = ",".join(etcd_cluster.endpoints)
    files = {}
    for v in (10, 11, 12, 13):
        files[v] = tmp_path / f"v{v}.json"
        files[v].write_bytes(encode_bundle(bump(base, v)))
    common = ["--etcd", ep, "--prefix", prefix]
    assert cli_main(["policy", "publish", str(files[10]), *common]) == 0
    assert cli_main(["policy", "canary", str(files[12]), "--regions", "eu", *common]) == 0
    capsys.readouterr()
    assert cli_main(["policy", "show", *common]) == 0  # was silent on the canary: the slice runs another bundle
    assert "\n  canary: bundle 12 staged for regions eu over 10 (`leasehold policy status`)\n" in capsys.readouterr().out
    assert cli_main(["policy", "publish", str(files[11]), *common]) == 0
    said = capsys.readouterr()
    assert said.out.startswith("published bundle 11 (previous 10)")
    assert said.err.startswith("leasehold: note: a canary is staged (bundle 12 for regions eu, over 10): its slice "
                               "keeps evaluating it, not this bundle; `policy promote` refuses it now"), said.err
    assert cli_main(["policy", "promote", *common]) == 3
    assert "was published after the candidate 12 was staged over 10" in capsys.readouterr().err
    assert cli_main(["policy", "publish", str(files[13]), "--over", "11", *common, "-o", "json"]) == 0
    said = capsys.readouterr()
    assert msgspec.json.decode(said.out)["canary"] == {"version": 12, "base": 10, "slice": "regions eu"}
    assert "its slice drops it for this bundle" in said.err
    assert cli_main(["policy", "show", *common, "-o", "json"]) == 0
    assert msgspec.json.decode(capsys.readouterr().out)["canary"] == {
        "valid": True, "problem": None, "refused": None, "bundleVersion": 12, "base": 10, "slice": "regions eu"}
    # re-staging a candidate that is not above the publish: told it may lack that publish's changes
    assert cli_main(["policy", "canary", str(files[12]), "--regions", "eu", *common]) == 2
    assert "not higher than the published 13 (which may hold changes the candidate does not" in capsys.readouterr().err


def test_canary_status_with_no_agent_answering_is_not_a_pass(etcd_cluster, prefix, tmp_path: Path, capsys):
    """``policy status`` is the gate before ``promote`` (exit 8: the canary denies more). With every agent
    unreachable it measured nothing and exited 0, the code of "not worse": a script gating on it promoted."""
    base = northstar()
    ep = ",".join(etcd_cluster.endpoints)
    common = ["--etcd", ep, "--prefix", prefix]
    for v in (10, 11):
        (tmp_path / f"v{v}.json").write_bytes(encode_bundle(bump(base, v)))
    assert cli_main(["policy", "publish", str(tmp_path / "v10.json"), *common]) == 0
    assert cli_main(["policy", "canary", str(tmp_path / "v11.json"), "--regions", "eu", *common]) == 0
    capsys.readouterr()
    dead = f"http://127.0.0.1:{free_port()}"
    assert cli_main(["policy", "status", "--agent-urls", dead, *common]) == 5
    said = capsys.readouterr().err
    assert said.startswith(f"leasehold: no agent answered on /metrics ({dead}: ") and said.count("\n") == 1, said
