"""The chaos topology: every link goes through a proxy (a partition of a region's allocator
links makes its agents decide from the fallback allowance), and stop() ends every process it
started by PID and closes the proxies."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from chaos import bundles
from chaos.nemesis import Partition
from chaos.topo import ChaosSpec, ChaosTopology
from tests.support.procs import alive


async def test_topology_links_are_proxied_and_stop_ends_every_process(tmp_path: Path) -> None:
    policy = bundles.write(tmp_path / "policy.json", bundles.chaos_bundle())
    topo = ChaosTopology(ChaosSpec(run_dir=tmp_path / "run", policy=policy, policy_etcd=False))
    try:
        topo.start()
        assert topo.etcd is not None and len(topo.etcd.procs) == 3
        assert len(topo.allocators) == 2 and all(len(a.etcd_proxies) == 3 for a in topo.allocators)
        assert await topo.wait_leader(20.0) is not None
        eu = topo.agents_in("eu")[0]
        # the agent reaches Redis and the allocators only through its proxies
        assert f"127.0.0.1:{eu.redis_proxy.port}" in " ".join(eu.proc.args)
        assert all(f"127.0.0.1:{p.port}" in " ".join(eu.proc.args) for p in eu.alloc_proxies)
        body = {"requestId": "req-00000001", "tenantId": "atlas", "principal": {"type": "user", "id": "U-1", "apiKeyId": "K1"},
                "routeGroup": "read", "method": "GET", "costHint": 1}
        async with httpx.AsyncClient(timeout=5.0) as c:
            r = await c.post(eu.url + "/v1/admit", json=body)
            assert r.status_code == 200, r.text
            ok = r.json()
            assert ok["allowed"] and not ok.get("fallback")
            cut = [Partition(p, target=p.name) for p in eu.alloc_proxies]
            for n in cut:
                await n.start()
            try:
                # drain the region's leases: once they are spent, decisions come from the fallback allowance
                # (the allocator is known unreachable only after the lease client's deadline of a few
                # seconds: bounded in time, not just in count)
                fallback = False
                deadline = time.monotonic() + 20.0
                for i in range(2_000):
                    d = (await c.post(eu.url + "/v1/admit", json={**body, "requestId": f"req-{i + 2:08d}"})).json()
                    if d.get("fallback"):
                        fallback = True
                        break
                    if time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.01)
                assert fallback, "a region cut off from the allocators decides from its fallback allowance"
            finally:
                for n in cut:
                    await n.stop()
        pids = [p.pid for p in topo.etcd.procs] + [a.proc.pid for a in topo.allocators] + \
               [g.proc.pid for g in topo.agents] + [r.proc.pid for r in topo.redis.values() if r.proc] + \
               [topo.host.proc.pid]
    finally:
        topo.stop()
    assert pids and not [p for p in pids if alive(p)]
    assert topo.host is not None and not topo.host.alive()  # the proxy host process too
