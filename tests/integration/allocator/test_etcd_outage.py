"""An etcd outage as the allocator's log shows it: the allocator as a process, its one-member etcd
stopped for a few seconds and started again. Every election round (four a second) fails its calls
on every endpoint; each failure used to be its own "trying the next endpoint" warning (dozens a
second, some 14,000 lines for a ten-minute outage), and each failed re-read of the followed bundle
its own "policy read from etcd failed". Now at most one line per endpoint every
``ENDPOINT_LOG_EVERY_S`` counts the others, the bundle's reads say when they start failing and
when they succeed again, and the allocator leads again once etcd is back."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx

from kernel.bundle import Pool
from kernel.etcd_store import ENDPOINT_LOG_EVERY_S
from leasehold.local.procs import LOOPBACK, EtcdCluster, Proc, free_port, wait_port
from leasehold.local.services import allocator_command
from tests.support.allocator_app import unique_prefix
from tests.support.policies import write_pools
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[3]
OUTAGE_S = 4.0


def test_an_etcd_outage_is_a_few_lines_not_one_per_failed_call(tmp_path: Path):
    assert OUTAGE_S < ENDPOINT_LOG_EVERY_S
    etcd = EtcdCluster(tmp_path / "etcd", members=1).start()
    bundle = write_pools(tmp_path / "pools.json", [Pool(id="p1", window_ms=60_000, limit=1_000, chunk_max=10)])
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_")}
    proc = Proc(f"alloc-{port}", allocator_command(
        etcd=",".join(etcd.endpoints), policy=bundle, node_id="a1", host=LOOPBACK, port=port, auth_disabled=True,
        prefix=unique_prefix(), election_ttl_s=3, policy_reread_ms=250), tmp_path / "a1", env={**env, "PYTHONPATH": str(ROOT)}).start()
    http = httpx.Client(base_url=f"http://{LOOPBACK}:{port}", timeout=5)

    def log() -> str:
        assert proc.log_path is not None
        return proc.log_path.read_text()
    try:
        wait_port(port, proc=proc.popen, timeout=30)
        assert wait_until(lambda: http.get("/v1/leader").json()["isSelf"], 30)
        etcd.stop_member(0)
        time.sleep(OUTAGE_S)
        assert http.get("/v1/health/store").json()["etcd"] == "unreachable"
        etcd.start_member(0)
        assert wait_until(lambda: http.get("/v1/health/store").status_code == 200 and http.get("/v1/leader").json()["isSelf"],
                   30)
        lines = [ln for ln in log().splitlines() if "trying the next endpoint" in ln]
        assert 1 <= len(lines) <= 2, "\n".join(lines[:20]) + f"\n... {len(lines)} lines"
        # the followed bundle's re-reads (every 250 ms here) failed all along: one line, then one
        # when etcd answers again
        assert wait_until(lambda: "policy read from etcd again" in log(), 15), log()
        failed = [ln for ln in log().splitlines() if "policy read from etcd failed" in ln]
        assert len(failed) == 1, "\n".join(failed[:20]) + f"\n... {len(failed)} lines"
    finally:
        http.close()
        proc.stop()
        etcd.stop()
