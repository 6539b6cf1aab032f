"""Usage reports / reclaim and the batch endpoint, against a real etcd (allocator in-process)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kernel.bundle import Pool
from kernel.etcd_store import EtcdStore
from kernel.wire import LeaseError, LeaseGrant, LeaseRequest, UsageReport
from leasehold.local.procs import EtcdCluster
from region_agent.leasing.client import AllocatorClient
from tests.support.allocator_app import in_process, lease_body, settings_for, unique_prefix

from .conftest import TestClock, W
from .support import etcd_grants, etcd_windows


def usage(lease_id: str, pool: str, region: str, spent: int) -> dict:
    return {"leaseId": lease_id, "pool": pool, "region": region, "spent": spent}


async def test_reclaim_returns_exactly_granted_minus_reported_once(
        etcd_cluster: EtcdCluster, make_bundle, prefix: str, clock: TestClock, etcd_reader: EtcdStore) -> None:
    bundle = make_bundle(Pool(id="p1", window_ms=W, limit=300, lease_ttl_ms=5_000, chunk_max=100))
    async with in_process(settings_for(etcd_cluster, bundle, prefix), clock=clock) as client:
        t0 = clock.place_in_window(W, 1_000, freeze=True)
        g = (await client.post("/v1/leases", json=lease_body("reclaim-lease-1", "p1", "eu", 80))).json()
        assert g["granted"] == 80 and g["remaining"] == 220
        url = "/v1/leases/reclaim-lease-1/usage"
        # before expiry on the allocator clock: refused, nothing returned
        early = await client.post(url, json=usage("reclaim-lease-1", "p1", "eu", 30))
        assert early.status_code == 409 and "not yet expired" in early.json()["detail"]
        clock.frozen = t0 + 5_000  # exactly the expiry
        too_much = await client.post(url, json=usage("reclaim-lease-1", "p1", "eu", 81))
        assert too_much.status_code == 422
        wrong = await client.post(url, json=usage("reclaim-lease-1", "p1", "us", 30))
        assert wrong.status_code == 404  # lease ids are per region: us has no such lease
        r = await client.post(url, json=usage("reclaim-lease-1", "p1", "eu", 30))
        assert r.status_code == 200
        assert r.json() == {"leaseId": "reclaim-lease-1", "granted": 80, "spent": 30, "returned": 50,
                            "windowOpen": True, "replayed": False}
        # a second report (even with another number) changes nothing and replays the receipt
        again = await client.post(url, json=usage("reclaim-lease-1", "p1", "eu", 0))
        assert again.json() == {**r.json(), "replayed": True}
        view = (await client.get("/v1/pools/p1")).json()
        assert view["remaining"] == 270 and view["leasesOutstanding"] == 0
        missing = await client.post("/v1/leases/reclaim-none-1/usage", json=usage("reclaim-none-1", "p1", "eu", 1))
        assert missing.status_code == 404
        # a lease reported after its window closed returns nothing: its unspent part is stranded
        g2 = (await client.post("/v1/leases", json=lease_body("reclaim-lease-2", "p1", "eu", 40))).json()
        g3 = (await client.post("/v1/leases", json=lease_body("reclaim-lease-3", "p1", "us", 25))).json()
        assert g3["granted"] == 25  # never reported
        clock.frozen = g2["window"]["endMs"] + 10
        late = (await client.post("/v1/leases/reclaim-lease-2/usage",
                                  json=usage("reclaim-lease-2", "p1", "eu", 15))).json()
        assert late["returned"] == 0 and late["windowOpen"] is False
        # a window retired by the leader counts the tokens of leases never reported
        clock.frozen = g2["window"]["endMs"] + W + 10
        await client.post("/v1/leases", json=lease_body("reclaim-lease-4", "p1", "eu", 1))
        text = (await client.get("/metrics")).text
        assert 'leasehold_allocator_unreported_tokens_total{pool="p1",region="us"} 25.0' in text
        assert 'leasehold_allocator_unreported_tokens_total{pool="p1",region="eu"}' not in text
        assert 'leasehold_allocator_stranded_tokens_total{pool="p1",region="eu"} 25.0' in text
        assert 'leasehold_allocator_reclaimed_tokens_total{pool="p1",region="eu"} 50.0' in text
    state = (await etcd_windows(etcd_reader, prefix, "p1"))[g2["window"]["index"]]
    assert state.remaining == 300 - 80 + 50 - 40 - 25
    assert state.returned == {"eu": 50}
    assert state.reported_tokens == {"eu": 120} and state.leases_outstanding == 1
    recs = await etcd_grants(etcd_reader, prefix)
    assert recs["reclaim-lease-1"].reported and recs["reclaim-lease-1"].returned == 50
    assert recs["reclaim-lease-2"].stranded == 25
    # the overshoot argument: spent tokens + outstanding grants never exceed G
    spent_or_held = sum(r.spent if r.reported else r.grant.granted for r in recs.values()
                        if r.grant.window.index == g2["window"]["index"])
    assert spent_or_held <= 300


async def test_batch_gives_the_same_results_as_single_grants(etcd_cluster: EtcdCluster, make_bundle,
                                                             clock: TestClock, etcd_reader: EtcdStore) -> None:
    pools = [Pool(id="a", window_ms=W, limit=250, chunk_min=1, chunk_max=90),
             Pool(id="b", window_ms=W, limit=40, chunk_min=1, chunk_max=30, regions=["eu", "us"])]
    bundle = make_bundle(*pools)
    reqs = []
    for i in range(40):
        region = ["eu", "us", "ap"][i % 3]
        reqs.append(lease_body(f"batch-{i:05d}", "ab"[i % 2], region, 5 + (i * 7) % 80, demand=(i * 3) % 40))
    reqs.append(lease_body("batch-unknown", "nope", "eu", 5))
    clock.place_in_window(W, 5_000, freeze=True)

    p_single, p_batch = unique_prefix(), unique_prefix()
    async with in_process(settings_for(etcd_cluster, bundle, p_single), clock=clock) as client:
        singles = [(await client.post("/v1/leases", json=r)).json() for r in reqs]
    async with in_process(settings_for(etcd_cluster, bundle, p_batch), clock=clock) as client:
        resp = await client.post("/v1/leases/batch", json={"requests": reqs})
        assert resp.status_code == 200
        batch = resp.json()["results"]
        dup = await client.post("/v1/leases/batch", json={"requests": [reqs[0], reqs[0]]})
        assert dup.status_code == 422
    assert len(batch) == len(singles)

    def norm(x: dict, req: dict) -> dict:
        if "granted" in x:
            return {k: v for k, v in x.items() if k not in ("epoch", "replayed")}
        code = x["code"] if "code" in x else x["type"].rsplit("/", 1)[1]
        return {"leaseId": req["leaseId"], "status": x["status"], "code": code}
    assert [norm(x, r) for x, r in zip(batch, reqs, strict=True)] == \
        [norm(x, r) for x, r in zip(singles, reqs, strict=True)]
    assert [x["leaseId"] for x in batch] == [r["leaseId"] for r in reqs]
    assert any(x.get("status") == 403 for x in batch)  # ap may not lease pool b
    assert batch[-1]["status"] == 404
    for p in (p_single, p_batch):
        for pool in ("a", "b"):
            (state,) = (await etcd_windows(etcd_reader, p, pool)).values()
            assert state.total_granted == state.limit - state.remaining


async def test_big_batch_over_many_pools_respects_etcd_txn_limits(etcd_cluster: EtcdCluster, make_bundle,
                                                                  prefix: str, etcd_reader: EtcdStore, clock: TestClock) -> None:
    pools = [Pool(id=f"t{i:03d}", window_ms=W, limit=100, chunk_max=50) for i in range(200)]
    bundle = make_bundle(*pools)
    reqs = [lease_body(f"big-{i:05d}", f"t{i % 200:03d}", "eu", 30) for i in range(512)]
    clock.place_in_window(W, 1_000)
    async with in_process(settings_for(etcd_cluster, bundle, prefix), clock=clock) as client:
        r = await client.post("/v1/leases/batch", json={"requests": reqs})
        assert r.status_code == 200
        results = r.json()["results"]
        text = (await client.get("/metrics")).text
    granted: dict[str, int] = {}
    for req, res in zip(reqs, results, strict=True):
        assert res["leaseId"] == req["leaseId"] and "granted" in res, res
        granted[req["pool"]] = granted.get(req["pool"], 0) + res["granted"]
    assert granted["t000"] == 30 * 3  # 512 requests over 200 pools: 3 requests for pools 0..111
    assert granted["t199"] == 30 * 2
    txns = float(text.split("leasehold_allocator_grants_per_txn_count ")[1].split()[0])
    assert 512 / 63 <= txns <= 20  # grouped, but within etcd's 128 ops per branch
    grants = await etcd_grants(etcd_reader, prefix)
    assert len(grants) == 512


async def test_usage_batch_gives_the_same_receipts_as_single_reports_and_reclaims_once(
        etcd_cluster: EtcdCluster, make_bundle, clock: TestClock, etcd_reader: EtcdStore) -> None:
    bundle = make_bundle(Pool(id="u1", window_ms=W, limit=1_000, lease_ttl_ms=5_000, chunk_max=100),
                         Pool(id="u2", window_ms=W, limit=500, lease_ttl_ms=5_000, chunk_max=100))
    t0 = clock.place_in_window(W, 1_000, freeze=True)
    leases = [lease_body(f"ub-{i:05d}", "u1u2"[i % 2 * 2:i % 2 * 2 + 2], "eu" if i % 3 else "us", 10 + i)
              for i in range(30)]
    reports = [usage(b["leaseId"], b["pool"], b["region"], i % 9) for i, b in enumerate(leases)]
    reports[3]["spent"] = 10_000  # more than granted: 422
    reports[4]["region"] = "ap"  # another region's lease id: ap has no such lease (ids are per region), 404
    reports[5]["pool"] = "u1" if reports[5]["pool"] == "u2" else "u2"  # another pool's lease: 409
    reports.append(usage("ub-never-granted", "u1", "eu", 0))  # unknown lease: 404
    reports.append(usage("ub-no-pool-1", "nope", "eu", 0))  # unknown pool: 404
    p_single, p_batch = unique_prefix(), unique_prefix()
    for p in (p_single, p_batch):
        clock.frozen = t0
        async with in_process(settings_for(etcd_cluster, bundle, p), clock=clock) as client:
            assert all("granted" in r for r in (await client.post("/v1/leases/batch",
                                                                  json={"requests": leases})).json()["results"])
            early = await client.post("/v1/usage/batch", json={"reports": reports[:2]})
            assert [r["status"] for r in early.json()["results"]] == [409, 409]  # not yet expired
            clock.frozen = t0 + 5_000
            if p == p_single:
                singles = [await client.post(f"/v1/leases/{r['leaseId']}/usage", json=r) for r in reports]
                single = [x.json() for x in singles]
            else:
                resp = await client.post("/v1/usage/batch", json={"reports": reports})
                assert resp.status_code == 200
                batch = resp.json()["results"]
                again = (await client.post("/v1/usage/batch", json={"reports": reports})).json()["results"]
                dup = await client.post("/v1/usage/batch", json={"reports": [reports[0], reports[0]]})
                assert dup.status_code == 422
            view = (await client.get("/v1/pools/u1")).json()
            text = (await client.get("/metrics")).text
        assert 'leasehold_allocator_reclaimed_tokens_total{pool="u1",region="eu"}' in text

    def norm(x: dict, rep: dict) -> dict:
        if "granted" in x:
            return x
        return {"leaseId": rep["leaseId"], "status": x["status"],
                "code": x["code"] if "code" in x else x["type"].rsplit("/", 1)[1]}
    assert [norm(x, r) for x, r in zip(batch, reports, strict=True)] == \
        [norm(x, r) for x, r in zip(single, reports, strict=True)]
    assert [x.get("status") for x in batch[3:6]] == [422, 404, 409] and [x["status"] for x in batch[-2:]] == [404, 404]
    # a repeated batch replays every receipt and changes nothing
    assert [x for x in again if "granted" in x] == [{**x, "replayed": True} for x in batch if "granted" in x]
    assert view["leasesOutstanding"] == 15 - sum(1 for x in batch[:30:2] if "granted" in x)
    for pool in ("u1", "u2"):
        for p in (p_single, p_batch):
            (state,) = (await etcd_windows(etcd_reader, p, pool)).values()
            granted = sum(10 + i for i, b in enumerate(leases) if b["pool"] == pool)
            returned = sum(x["returned"] for x, b in zip(batch, leases, strict=False) if b["pool"] == pool
                           and "granted" in x)
            assert state.total_granted == granted and state.total_returned == returned
            assert state.remaining == state.limit - granted + returned


async def test_concurrent_reports_of_one_lease_reclaim_once(etcd_cluster: EtcdCluster, make_bundle, prefix: str,
                                                            clock: TestClock, etcd_reader: EtcdStore) -> None:
    import asyncio

    bundle = make_bundle(Pool(id="c1", window_ms=W, limit=1_000, lease_ttl_ms=5_000, chunk_max=500))
    t0 = clock.place_in_window(W, 1_000, freeze=True)
    async with in_process(settings_for(etcd_cluster, bundle, prefix), clock=clock) as client:
        g = (await client.post("/v1/leases", json=lease_body("conc-rep-1", "c1", "eu", 300))).json()
        assert g["granted"] == 300
        clock.frozen = t0 + 5_000
        rep = usage("conc-rep-1", "c1", "eu", 100)
        answers = await asyncio.gather(
            *(client.post("/v1/leases/conc-rep-1/usage", json=rep) for _ in range(5)),
            *(client.post("/v1/usage/batch", json={"reports": [rep]}) for _ in range(5)))
    receipts = [a.json() if "leaseId" in a.json() else a.json()["results"][0] for a in answers]
    assert all(r["returned"] == 200 for r in receipts), receipts
    assert sorted(r["replayed"] for r in receipts) == [False] + [True] * 9  # exactly one applied it
    (state,) = (await etcd_windows(etcd_reader, prefix, "c1")).values()
    assert state.remaining == 1_000 - 300 + 200 and state.returned == {"eu": 200} and state.reported == {"eu": 1}


class _CountingTransport(httpx.AsyncBaseTransport):
    """The in-process allocator app (the test client's transport: the app runs in its own thread and
    loop), counting requests per path; ``gone`` paths answer 404 as an allocator from before they
    existed would."""

    def __init__(self, inner: httpx.AsyncBaseTransport, gone: tuple[str, ...] = ()):
        self.inner = inner
        self.paths: list[str] = []
        self.gone = gone

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        if request.url.path in self.gone:
            return httpx.Response(404, json={"type": "https://leasehold.dev/problems/not-found", "status": 404,
                                             "detail": f"no route {request.url.path}"})
        return await self.inner.handle_async_request(request)


@pytest.mark.parametrize("old_allocator", [False, True])
async def test_the_agents_client_sends_usage_reports_in_batches(etcd_cluster: EtcdCluster, make_bundle, prefix: str,
                                                                clock: TestClock, etcd_reader: EtcdStore,
                                                                old_allocator: bool) -> None:
    bundle = make_bundle(Pool(id="ag", window_ms=W, limit=1_000, lease_ttl_ms=5_000, chunk_max=100))
    t0 = clock.place_in_window(W, 1_000, freeze=True)
    async with in_process(settings_for(etcd_cluster, bundle, prefix), clock=clock) as tc:
        transport = _CountingTransport(tc._transport, gone=("/v1/usage/batch",) if old_allocator else ())
        client = AllocatorClient(["http://allocator.test"], transport=transport, deadline_s=10)
        try:
            grants = await asyncio.gather(*(client.lease(LeaseRequest(lease_id=f"agrep-{i:04d}", region="eu", pool="ag",
                                                                      want=10)) for i in range(20)))
            assert all(isinstance(g, LeaseGrant) for g in grants)
            clock.frozen = t0 + 5_000
            reports = [UsageReport(lease_id=f"agrep-{i:04d}", region="eu", pool="ag", spent=i % 10) for i in range(20)]
            reports.append(UsageReport(lease_id="agrep-unknown", region="eu", pool="ag", spent=0))
            transport.paths.clear()
            results = await client.report_many(reports)
        finally:
            await client.aclose()
    assert [r.returned for r in results[:20]] == [10 - i % 10 for i in range(20)]
    assert isinstance(results[20], LeaseError) and results[20].status == 404
    if old_allocator:  # one batch attempt answered 404, then the reports one at a time
        assert transport.paths == ["/v1/usage/batch"] + [f"/v1/leases/{r.lease_id}/usage" for r in reports]
    else:
        assert transport.paths == ["/v1/usage/batch"]  # 21 reports, one request
    (state,) = (await etcd_windows(etcd_reader, prefix, "ag")).values()
    assert state.remaining == 1_000 - 200 + sum(10 - i % 10 for i in range(20))
