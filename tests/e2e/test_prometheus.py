"""A real Prometheus (Debian's ``prometheus``, installed by ``make``) scrapes a ``leasehold up``
topology with the shipped configuration (deploy/prometheus/prometheus.yml, targets filled in,
1 s scrape and evaluation intervals) and evaluates the shipped alert rules as they are:

* right after the start (no traffic, counters not yet created) and then under ordinary paced
  traffic (a tenant over its quota, pools far from G, every door): no alert even goes pending
  (with ``--workers 2``: tests/e2e/test_prometheus_workers.py, a file of its own so that the
  suite's two workers run both at once);
* one RLS call, one RLQS stream and one forward-auth call without the gateway token to every
  agent: no critical alert even goes pending (LeaseholdRlsUnknownCaller,
  LeaseholdRlqsUnknownCaller and LeaseholdAuthzUnknownCaller, warnings, do), no stream is
  counted as one the agent refused itself (LeaseholdRlqsStreamsAtCap's series, at 0), and every
  agent's stream cap is scraped as configured (LeaseholdRlqsStreamsNearCap's);
* healthy, under demo traffic through every door: no critical alert fires, and every panel of
  the Grafana dashboard has a query that returns series from this Prometheus;
* Redis of region eu stopped and the allocator leader killed: LeaseholdBreakerOpen (for: 1m)
  and LeaseholdFailClosedActivation for the eu agent, LeaseholdAllocatorFailover; and
  LeaseholdFallbackShareHigh pending (its floor of 30 fallback decisions in 5 minutes is passed
  by a store outage at demo traffic; its ``for:`` of 5 minutes is the promtool cases');
* every allocator stopped: LeaseholdAllocatorsAbsent (for: 30s).

Alerts whose ``for:`` or range is several minutes (fallback share, latency, overshoot, deny ratio
after a rollout, tenant share, ...) are exercised by the promtool cases
(tests/unit/deploy/test_alert_rules.py), not here: this test would take their ``for:`` in wall time.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import grpc
import httpx
import pytest
import yaml
from envoy.service.rate_limit_quota.v3 import rlqs_pb2, rlqs_pb2_grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from devtools.deploy_check import dashboard_queries
from leasehold.local.prometheus_config import render
from leasehold.local.topology import LocalTopology, TopologySpec
from tests.support.prometheus import (
    STARVED_MACHINE_BUDGETS,
    Background,
    Prom,
    descriptor,
    quiet_then_ordinary,
    running_prometheus,
)
from tests.support.waiting import wait_until

pytestmark = pytest.mark.e2e

RLQS_CAP = 512  # every agent's --rlqs-max-streams (the default is 1,024): its gauge carries this one


class Traffic(Background):
    """Demo traffic in a background thread, bounded in time: admissions of every kind, forward
    auth (one malformed question now and then) and RLS calls, to every region's agent."""

    def __init__(self, topo: LocalTopology, max_s: float = 420.0):
        super().__init__(topo)
        self.max_s = max_s
        self.sent = 0

    def _run(self) -> None:
        started = time.monotonic()
        i = 0
        with self.clients() as (c, stubs, meta):
            while not self.stop.is_set() and time.monotonic() - started < self.max_s:
                for urls in self.topo.agent_urls.values():
                    url = urls[0]
                    for body in ({"tenantId": "atlas", "principal": {"type": "user", "id": "U-17", "apiKeyId": "K1"},
                                  "routeGroup": "read"},
                                 {"tenantId": "birch", "principal": {"type": "user", "id": f"B-{i % 7}"},
                                  "routeGroup": "read"},
                                 {"tenantId": "atlas", "principal": {"type": "user", "id": "U-2"},
                                  "routeGroup": "export"},
                                 {"principal": {"type": "anonymous", "id": "203.0.113.9"}, "routeGroup": "login"},
                                 {"tenantId": "northstar-ops", "principal": {"type": "service", "id": "prober"},
                                  "routeGroup": "probe"}):
                        i += 1
                        self._quietly(c.post, url + "/v1/admit", json={"requestId": f"prom-{i:08d}", **body})
                    self._quietly(c.get, url + "/v1/authz/catalog", headers={
                        "x-tenant-id": "birch", "x-user-id": f"B-{i % 5}", "x-route-group": "read"})
                    if i % 50 == 0:  # a malformed question (counted by reason)
                        self._quietly(c.get, url + "/v1/authz/catalog", headers={"x-tenant-id": "birch"})
                for stub in stubs:
                    self._quietly(stub.ShouldRateLimit, rls_pb2.RateLimitRequest(
                        domain="leasehold", descriptors=[descriptor(tenant="atlas", user="U-9", route_group="read")]),
                        metadata=meta, timeout=3)
                    if i % 50 == 0:
                        self._quietly(stub.ShouldRateLimit, rls_pb2.RateLimitRequest(
                            domain="leasehold", descriptors=[descriptor(nope="x")]), metadata=meta, timeout=3)
                self.sent += 1
                time.sleep(0.05)

    @staticmethod
    def _quietly(call, *args, **kw) -> None:
        try:
            call(*args, **kw)
        except (httpx.HTTPError, grpc.RpcError):
            pass  # faults are injected while traffic runs


@pytest.fixture(scope="module")
def topology(tmp_path_factory):
    topo = LocalTopology(TopologySpec(run_dir=tmp_path_factory.mktemp("prom-topo"), regions=("eu", "us"),
                                      allocators=2, auth=True, rls=True,
                                      agent_args=("--rlqs-max-streams", str(RLQS_CAP),
                                                  *STARVED_MACHINE_BUDGETS))).start()
    yield topo
    topo.stop()


@pytest.fixture(scope="module")
def prometheus(topology, tmp_path_factory):
    with running_prometheus(topology, tmp_path_factory.mktemp("prometheus")) as prom:
        yield prom


def _critical_firing(prom: Prom) -> list[dict]:
    return [a for a in prom.alerts() if a["labels"].get("severity") == "critical" and a["state"] == "firing"]


def _wait_active(prom: Prom, name: str, timeout: float) -> list[dict]:
    """``name`` pending or firing within ``timeout`` seconds."""
    got = wait_until(lambda: [a for a in prom.alerts() if a["labels"]["alertname"] == name], timeout, interval=1)
    assert got, f"{name} did not go pending within {timeout:.0f} s; alerts: {prom.alerts()}"
    return got


def _wait_firing(prom: Prom, name: str, timeout: float, **labels: str) -> list[dict]:
    got = wait_until(lambda: prom.firing(name, **labels), timeout, interval=1)
    assert got, f"{name} {labels} did not fire within {timeout:.0f} s; alerts: {prom.alerts()}"
    return got


def test_healthy_quiet_and_ordinary_traffic_leave_every_alert_inactive(topology, prometheus):
    """Right after the start (counters not yet created, nothing to divide by) and then under
    ordinary traffic with a tenant over its quota, no alert of the shipped rules may even go
    pending: a pending alert is one ``for:`` away from paging someone for a healthy fleet.
    (Runs before the fault test below, on the same fresh topology.)"""
    quiet_then_ordinary(topology, prometheus)


def test_a_call_without_the_gateway_token_pages_nobody(topology, prometheus):
    """One RLS call, one RLQS stream and one forward-auth call without the gateway token to every
    agent (what any pod of the cluster can send: the agents' ports are open to it): no critical
    alert even goes pending — a caller that is not a gateway does not control the pager. The security warnings
    see them (pending: one call is under their ``for:`` of 10 minutes, which the promtool cases
    check). (Runs after the test above, before the fault test below, on the same topology.)"""
    prom = prometheus
    sent = 0
    for ports in topology.rls_ports.values():
        for port in ports:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                with pytest.raises(grpc.RpcError) as e:
                    rls_pb2_grpc.RateLimitServiceStub(ch).ShouldRateLimit(rls_pb2.RateLimitRequest(
                        domain="leasehold", descriptors=[descriptor(tenant="atlas", user="U-9", route_group="read")]),
                        timeout=5)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                report = rlqs_pb2.RateLimitQuotaUsageReports(domain="leasehold")
                with pytest.raises(grpc.RpcError) as e:
                    list(rlqs_pb2_grpc.RateLimitQuotaServiceStub(ch).StreamRateLimitQuotas(iter([report]),
                                                                                           timeout=5))
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                sent += 1
    for urls in topology.agent_urls.values():
        r = httpx.get(urls[0] + "/v1/authz/catalog", headers={"x-tenant-id": "birch", "x-user-id": "B-1",
                                                               "x-route-group": "read"}, timeout=5)
        assert r.status_code == 401
    assert sent > 0
    # the warnings go pending once Prometheus scraped the refusals; then 15 more evaluations
    _wait_active(prom, "LeaseholdRlsUnknownCaller", 30)
    _wait_active(prom, "LeaseholdRlqsUnknownCaller", 30)
    _wait_active(prom, "LeaseholdAuthzUnknownCaller", 30)
    for _ in range(15):
        critical = [a for a in prom.alerts() if a["labels"].get("severity") == "critical"]
        assert not critical, critical
        time.sleep(1)
    # a stream refused for its token is not one the agent refused itself: LeaseholdRlqsStreamsAtCap
    # reads a series of every agent, scraped at 0 from the start, that those streams left at 0
    refused = prom.query('leasehold_agent_rlqs_refused_streams_total{reason="exhausted"}')
    assert len(refused) == sent and {r["value"][1] for r in refused} == {"0"}, refused
    # LeaseholdRlqsStreamsNearCap compares the streams open with the cap each agent exports: the
    # cap of every agent is scraped, as configured, and the streams refused left none open
    cap = prom.query("leasehold_agent_rlqs_max_streams")
    assert len(cap) == sent and {c["value"][1] for c in cap} == {str(RLQS_CAP)}, cap
    streams = prom.query("leasehold_agent_rlqs_streams")
    assert len(streams) == sent and {s["value"][1] for s in streams} == {"0"}, streams
    # the rule itself reads the fullest worker's fraction of the cap: scraped at 0 from the start
    fill = prom.query("leasehold_agent_rlqs_streams_fill")
    assert len(fill) == sent and {f["value"][1] for f in fill} == {"0"}, fill


def test_alerts_and_panels_on_a_real_prometheus(topology, prometheus):
    prom = prometheus
    panels = dashboard_queries()
    with Traffic(topology) as traffic:
        # healthy: at least 40 s of evaluations (1 s apart) without a critical alert, and every
        # panel backed by series (leases and pool balances need a few ticks)
        started = time.monotonic()
        empty: list[str] = [title for title, _ in panels]
        while True:
            assert not _critical_firing(prom), _critical_firing(prom)
            empty = [title for title, qs in panels if not any(prom.query(q.expr) for q in qs)]
            if (not empty and time.monotonic() - started > 40) or time.monotonic() - started > 120:
                break
            time.sleep(2)
        assert not empty, f"dashboard panels without series on Prometheus: {empty}"
        assert not _critical_firing(prom)
        assert traffic.sent > 0 and prom.query('sum(rate(leasehold_agent_rls_requests_total{outcome="ok"}[1m])) > 0')

        # faults: region eu's Redis stopped; the allocator leader killed
        leader = httpx.get(topology.allocator_urls[0] + "/v1/leader", timeout=5).json()
        leader_url = leader["url"].rstrip("/")
        i = topology.allocator_urls.index(leader_url)
        topology.redis["eu"].stop()
        os.kill(topology.allocators[i].pid, signal.SIGKILL)
        eu = topology.agent_urls["eu"][0].split("://", 1)[1]
        _wait_firing(prom, "LeaseholdAllocatorFailover", 60)
        _wait_firing(prom, "LeaseholdFailClosedActivation", 60, instance=eu)
        _wait_active(prom, "LeaseholdFallbackShareHigh", 60)

        # every allocator stopped while eu's breaker is still in its ``for: 1m`` (the two waits
        # overlap: the breaker answers to Redis alone, the absence alert to the allocators' scrapes)
        for proc in topology.allocators:
            proc.stop()
        _wait_firing(prom, "LeaseholdBreakerOpen", 150, instance=eu)
        assert not prom.firing("LeaseholdBreakerOpen", instance=topology.agent_urls["us"][0].split("://", 1)[1])
        _wait_firing(prom, "LeaseholdAllocatorsAbsent", 90)


def test_the_rendered_config_keeps_the_shipped_jobs_and_labels(topology):
    doc = render(topology.allocator_urls, topology.agent_urls)
    jobs = {j["job_name"]: j for j in doc["scrape_configs"]}
    assert set(jobs) == {"leasehold-allocator", "leasehold-agent"}
    assert {c["labels"]["region"] for c in jobs["leasehold-agent"]["static_configs"]} == {"eu", "us"}
    assert doc["rule_files"] == [str(Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml")]
    res = subprocess.run([shutil.which("promtool") or "promtool", "check", "config", "--syntax-only", "/dev/stdin"],
                         input=yaml.safe_dump(doc), capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr
