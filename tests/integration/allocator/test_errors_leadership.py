"""Malformed input, followers, fencing and an unreachable etcd (allocator in-process, real etcd)."""

from __future__ import annotations

from allocator.settings import AllocatorSettings
from kernel.bundle import Pool
from kernel.etcd_store import EtcdStore
from leasehold.local.procs import EtcdCluster
from tests.support.allocator_app import in_process, lease_body, settings_for
from tests.support.waiting import await_until

from .conftest import TestClock, W
from .support import etcd_grants, etcd_windows, usurp

PROBLEM = "application/problem+json"


async def test_malformed_bodies_get_4xx_problems(etcd_cluster: EtcdCluster, make_bundle, prefix: str,
                                                 etcd_reader: EtcdStore) -> None:
    bundle = make_bundle(Pool(id="p1", window_ms=W, limit=100, chunk_max=50, regions=["eu"]))
    ok = lease_body("good-lease-1", "p1", "eu", 5)
    cases: list[tuple[str, dict | bytes, int]] = [
        ("/v1/leases", b"{not json", 400),
        ("/v1/leases", b"[]", 400),
        ("/v1/leases", {**ok, "want": 0}, 400),
        ("/v1/leases", {**ok, "want": "many"}, 400),
        ("/v1/leases", {**ok, "leaseId": "short"}, 400),
        ("/v1/leases", {**ok, "surprise": 1}, 400),
        ("/v1/leases", {**ok, "window": "later"}, 400),
        ("/v1/leases", {k: v for k, v in ok.items() if k != "region"}, 400),
        ("/v1/leases", {**ok, "pool": "unknown"}, 404),
        ("/v1/leases", {**ok, "region": "us"}, 403),
        ("/v1/leases/batch", {"requests": []}, 400),
        ("/v1/leases/batch", {"requests": [ok] * 513}, 400),
        ("/v1/leases/batch", b"\x00\x01", 400),
        ("/v1/leases/good-lease-1/usage", {"leaseId": "good-lease-2", "pool": "p1", "region": "eu", "spent": 1},
         400),
        ("/v1/leases/bad!id/usage", {"leaseId": "good-lease-1", "pool": "p1", "region": "eu", "spent": 1}, 400),
        ("/v1/leases/good-lease-1/usage", {"leaseId": "good-lease-1", "pool": "p1", "region": "eu", "spent": -1},
         400),
        ("/v1/leases", b"{" + b" " * (2 * 1024 * 1024) + b"}", 413),
    ]
    async with in_process(settings_for(etcd_cluster, bundle, prefix)) as client:
        for path, body, status in cases:
            if isinstance(body, bytes):
                r = await client.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = await client.post(path, json=body)
            assert r.status_code == status, (path, str(body)[:80], r.status_code, r.text)
            assert r.headers["content-type"].startswith(PROBLEM), r.headers
            problem = r.json()
            assert problem["status"] == status and problem["type"].startswith("https://leasehold.dev/problems/")
            assert problem["detail"]
        r = await client.get("/v1/leases/nosuch-lease?region=eu")
        assert r.status_code == 404 and r.headers["content-type"].startswith(PROBLEM)
        r = await client.get("/v1/leases/nosuch-lease")  # auth off: which region's lease is not implied
        assert r.status_code == 400 and r.headers["content-type"].startswith(PROBLEM)
        r = await client.get("/v1/pools/nosuch")
        assert r.status_code == 404 and r.headers["content-type"].startswith(PROBLEM)
        r = await client.get("/v1/pools/" + "x" * 4000)  # a caller's long id is not echoed whole
        assert r.status_code == 404 and len(r.text) < 700 and "x" * 257 not in r.text, r.text[:200]
        assert "x" * 65 not in r.json()["detail"]
        r = await client.get("/v1/nothing-here")
        assert r.status_code == 404 and r.headers["content-type"].startswith(PROBLEM)
        schema = await client.get("/schema/openapi.json")
        assert schema.status_code == 200 and "/v1/leases" in schema.json()["paths"]
        assert (await client.get("/healthz")).status_code == 200
        pools = (await client.get("/v1/pools")).json()
        assert pools == [{"id": "p1", "limit": 100, "windowMs": W, "leaseTtlMs": 15_000, "chunkMin": 1,
                          "chunkMax": 50, "fallbackPerRegion": 0}]
    assert await etcd_grants(etcd_reader, prefix) == {}  # nothing was granted by any bad request


async def test_follower_answers_503_not_leader_naming_the_leader(etcd_cluster: EtcdCluster, make_bundle,
                                                                 prefix: str) -> None:
    bundle = make_bundle(Pool(id="p1", window_ms=W, limit=100, chunk_max=50))
    leader_settings = settings_for(etcd_cluster, bundle, prefix, node_id="lead", port=18001)
    follower_settings = settings_for(etcd_cluster, bundle, prefix, node_id="follow", port=18002)
    async with in_process(leader_settings) as leader:
        from litestar.testing import AsyncTestClient

        from allocator.app import create_app
        app = create_app(follower_settings)
        async with AsyncTestClient(app=app) as follower:
            assert await await_until(lambda: app.state.election.role_known), \
                "the follower never learned its role"
            info = (await follower.get("/v1/leader")).json()
            lead_info = (await leader.get("/v1/leader")).json()
            assert info == {**lead_info, "isSelf": False, "leading": 0}  # (leading: how many shards it leads)
            assert info["nodeId"] == "lead" and info["url"] == "http://127.0.0.1:18001"
            r = await follower.post("/v1/leases", json=lease_body("follow-lease-1", "p1", "eu", 5))
            assert r.status_code == 503 and r.headers["content-type"].startswith(PROBLEM)
            body = r.json()
            assert body["type"].endswith("/not-leader") and body["retriable"] is True
            assert body["leader"] == "http://127.0.0.1:18001" and body["epoch"] == lead_info["epoch"]
            r = await follower.post("/v1/leases/batch", json={"requests": [lease_body("follow-lease-2", "p1",
                                                                                      "eu", 5)]})
            assert r.json()["results"][0]["code"] == "not-leader"
            ready = (await follower.get("/readyz")).json()
            assert ready["role"] == "follower"
            # reads work on any replica
            assert (await follower.get("/v1/pools/p1")).status_code == 200


async def test_a_deposed_leader_cannot_commit(etcd_cluster: EtcdCluster, make_bundle, prefix: str,
                                              etcd_reader: EtcdStore, clock: TestClock) -> None:
    """The epoch compare inside the transaction, on its own: the leader still believes it leads
    (its keepalive is recent) while another node took the key; its grant must not commit."""
    bundle = make_bundle(Pool(id="p1", window_ms=W, limit=100, chunk_max=50))
    settings = settings_for(etcd_cluster, bundle, prefix)
    clock.place_in_window(W, 1_000)
    async with in_process(settings, clock=clock) as client:
        election = client.app_state.election
        first = (await client.post("/v1/leases", json=lease_body("fence-lease-1", "p1", "eu", 10))).json()
        old_epoch = first["epoch"]
        # depose: another node replaces the leader key (a new create_revision = a new epoch)
        key = f"{prefix}leader".encode()
        lease = await usurp(etcd_reader, key, old_epoch)
        new_epoch = (await etcd_reader.get(key)).create_revision
        assert new_epoch > old_epoch
        assert election.is_leader  # it has not noticed yet
        r = await client.post("/v1/leases", json=lease_body("fence-lease-2", "p1", "eu", 10))
        assert r.status_code == 503 and r.json()["type"].endswith("/fenced")
        assert not election.is_leader  # stepped down at once
        assert "leasehold_allocator_fenced_total 1.0" in (await client.get("/metrics")).text
        await etcd_reader.lease_revoke(lease)
    grants = await etcd_grants(etcd_reader, prefix)
    assert set(grants) == {"fence-lease-1"}
    (state,) = (await etcd_windows(etcd_reader, prefix, "p1")).values()
    assert state.remaining == 90


async def test_etcd_unreachable_503_and_nothing_granted(fresh_etcd_cluster: EtcdCluster, make_bundle,
                                                        prefix: str, clock: TestClock) -> None:
    cluster = fresh_etcd_cluster
    bundle = make_bundle(Pool(id="p1", window_ms=W, limit=100, chunk_max=50))
    settings = AllocatorSettings(etcd=",".join(cluster.endpoints), policy=str(bundle), node_id="n1",
                                 prefix=prefix, etcd_timeout_ms=300, election_ttl_s=2, auth_disabled=True)
    clock.place_in_window(W, 1_000)
    async with in_process(settings, clock=clock) as client:
        cluster.stop_member(0)  # the endpoint the allocator talks to: it must move to the next one
        r = await client.post("/v1/leases", json=lease_body("down-lease-0", "p1", "eu", 5))
        if r.status_code == 503:  # the leader may have stepped down on a failed keepalive: wait, retry
            assert await await_until(lambda: client.app_state.election.is_leader, within_s=20), \
                "the leader did not take the lead again"
            r = await client.post("/v1/leases", json=lease_body("down-lease-0", "p1", "eu", 5))
        assert r.status_code == 200, r.text
        for i in range(1, len(cluster.procs)):
            cluster.stop_member(i)
        r = await client.post("/v1/leases", json=lease_body("down-lease-1", "p1", "eu", 5))
        assert r.status_code == 503 and r.headers["content-type"].startswith(PROBLEM)
        assert r.json()["retriable"] is True and r.headers["retry-after"] == "1"
        assert await await_until(lambda: not client.app_state.election.is_leader, within_s=10), \
            "the leader did not step down with etcd down"
        r = await client.post("/v1/leases", json=lease_body("down-lease-2", "p1", "eu", 5))
        assert r.status_code == 503
        # etcd down: the replica still answers (retriable 503s), so it stays ready; etcd's health is
        # reported on its own endpoint
        assert (await client.get("/readyz")).status_code == 200
        health = await client.get("/v1/health/store")
        assert health.status_code == 503 and health.json()["etcd"] == "unreachable"
        assert (await client.get("/healthz")).status_code == 200
        for i in range(len(cluster.procs)):
            cluster.procs[i].start()
        cluster.wait_healthy()
        assert await await_until(lambda: client.app_state.election.is_leader, within_s=20), \
            "the leader did not take the lead again after etcd came back"
        assert (await client.get("/readyz")).json()["role"] == "leader"
        health = await client.get("/v1/health/store")
        assert health.status_code == 200 and health.json()["etcd"] == "reachable"
    reader = EtcdStore(",".join(cluster.endpoints), timeout_s=5)
    try:
        grants = await etcd_grants(reader, prefix)
        assert set(grants) == {"down-lease-0"}
        (state,) = (await etcd_windows(reader, prefix, "p1")).values()
        assert state.remaining == 95
    finally:
        await reader.close()


async def test_auth_hook_guards_lease_endpoints_only(etcd_cluster: EtcdCluster, make_bundle, prefix: str) -> None:
    from kernel.errors import Unauthorized

    def guard(connection, _handler) -> None:
        if connection.headers.get("authorization") != "Bearer eu-token":
            raise Unauthorized("region token required")

    bundle = make_bundle(Pool(id="p1", window_ms=W, limit=100, chunk_max=50))
    async with in_process(settings_for(etcd_cluster, bundle, prefix), auth_guard=guard) as client:
        r = await client.post("/v1/leases", json=lease_body("auth-lease-1", "p1", "eu", 5))
        assert r.status_code == 401 and r.headers["content-type"].startswith(PROBLEM)
        r = await client.post("/v1/leases", json=lease_body("auth-lease-1", "p1", "eu", 5),
                              headers={"authorization": "Bearer eu-token"})
        assert r.status_code == 200 and r.json()["granted"] == 5
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.get("/v1/leader")).status_code == 200
