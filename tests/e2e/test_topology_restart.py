"""`make run` twice in the same run directory: the second start gets a fresh etcd (the first
run's data dir had authentication on with users of a run that no longer exists), and stop()
leaves no process behind."""

from __future__ import annotations

import httpx

from leasehold.local.topology import LocalTopology, TopologySpec
from tests.support.procs import alive


def test_second_start_in_the_same_run_dir_works_and_stop_leaves_nothing(tmp_path):
    # the first admission after a start waits for its pool's first lease (an allocator round trip,
    # over a second on a loaded machine) up to --cold-lease-wait-ms beyond its budget, else it is a
    # pool-busy 429 (seen beside busy cores with the 600 ms default): room for a slow round trip, since
    # this test is about the restart, not about how long a first lease may take
    spec = TopologySpec(run_dir=tmp_path / "run", regions=("eu",), allocators=1, auth=True,
                        agent_args=("--cold-lease-wait-ms", "5000"))
    pids: list[int] = []
    for attempt in range(2):
        topo = LocalTopology(spec).start()
        try:
            pids += [s.pid for s in topo.services()]
            r = httpx.post(topo.agent_urls["eu"][0] + "/v1/admit", headers=topo.gateway_headers(), timeout=5,
                           json={"requestId": f"restart-{attempt:04d}", "tenantId": "birch",
                                 "principal": {"type": "user", "id": "B-1"}, "routeGroup": "read", "method": "GET"})
            assert r.status_code == 200 and r.json()["allowed"] is True, r.text
        finally:
            topo.stop()
    assert pids and not [p for p in pids if alive(p)]
