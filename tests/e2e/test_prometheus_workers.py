"""The shipped alert rules on a real Prometheus over agents run with ``--workers 2``
(prometheus_client's multiprocess mode: the gauges a rule compares are the workers' combined; the
closed fail modes' zero series): right after the start and under ordinary traffic, no alert even
goes pending. The one-process fleet's test is tests/e2e/test_prometheus.py's; this one is a file of
its own so that the suite's two workers run both at once (each waits on a Prometheus for minutes)."""

from __future__ import annotations

import pytest

from leasehold.local.topology import LocalTopology, TopologySpec
from tests.support.prometheus import STARVED_MACHINE_BUDGETS, quiet_then_ordinary, running_prometheus

pytestmark = pytest.mark.e2e


def test_healthy_agents_with_two_workers_leave_every_alert_inactive(tmp_path):
    topo = LocalTopology(TopologySpec(run_dir=tmp_path / "topo", regions=("eu", "us"), allocators=1, auth=True,
                                      rls=True, agent_args=("--workers", "2", *STARVED_MACHINE_BUDGETS))).start()
    try:
        (tmp_path / "prometheus").mkdir()
        with running_prometheus(topo, tmp_path / "prometheus") as prom:
            quiet_then_ordinary(topo, prom)
    finally:
        topo.stop()
