"""A real Prometheus for the e2e tests (Debian's ``prometheus``, installed by ``make``) scraping a
``leasehold up`` topology with the shipped configuration and rules, and the ordinary traffic under
which none of the shipped alerts may even go pending (tests/e2e/test_prometheus*.py)."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Self

import grpc
import httpx
import yaml
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from leasehold.local.procs import LOOPBACK, Proc, free_port, wait_port
from leasehold.local.prometheus_config import render
from leasehold.local.topology import LocalTopology

D = ratelimit_pb2.RateLimitDescriptor
# The agents' store budgets for a topology whose healthy phases must not page: a decision whose
# script call waits past --decision-budget-ms (50 ms) unsent is DEADLINE, and a fail-closed rule
# (the sample bundle's export-tenant) then really answers 503 and counts a fail-closed decision, which
# LeaseholdFailClosedActivation (critical, no ``for:``) rightly fires on. A starved shared machine
# (two cores, both busy) once held the agent's event loop past 50 ms; these budgets it meets, and a
# stopped Redis still fails at once (connection refused), so the fault phases page as before.
STARVED_MACHINE_BUDGETS = ("--decision-budget-ms", "1000", "--redis-socket-timeout-ms", "2000")
# a lease ended with tokens unspent (a window ended under traffic)
STRANDED = 'sum(rate(leasehold_allocator_stranded_tokens_total[5m])) > 0'


def descriptor(**entries: str) -> ratelimit_pb2.RateLimitDescriptor:
    return D(entries=[D.Entry(key=k, value=v) for k, v in entries.items()])


class Background:
    """A loop (``_run``, which returns once ``stop`` is set) in a thread for a ``with`` block."""

    def __init__(self, topo: LocalTopology):
        self.topo = topo
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)

    def _run(self) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def clients(self) -> Iterator[tuple[httpx.Client, list[rls_pb2_grpc.RateLimitServiceStub], tuple]]:
        """What a gateway would ask with: an HTTP client sending the gateway's headers, an RLS stub
        per agent process, and the gateway's credentials as gRPC metadata."""
        gw = self.topo.gateway_headers()
        meta = tuple((k.lower(), v) for k, v in gw.items())
        channels = [grpc.insecure_channel(f"{LOOPBACK}:{p}") for ports in self.topo.rls_ports.values() for p in ports]
        try:
            with httpx.Client(timeout=3, headers=gw) as c:
                yield c, [rls_pb2_grpc.RateLimitServiceStub(ch) for ch in channels], meta
        finally:
            for ch in channels:
                ch.close()


class Prom:
    def __init__(self, url: str):
        self.url = url

    def query(self, expr: str) -> list[dict]:
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def rule_groups(self) -> list[dict]:
        return httpx.get(self.url + "/api/v1/rules", timeout=10).json()["data"]["groups"]

    def alerts(self) -> list[dict]:
        return httpx.get(self.url + "/api/v1/alerts", timeout=10).json()["data"]["alerts"]

    def firing(self, name: str, **labels: str) -> list[dict]:
        return [a for a in self.alerts() if a["labels"]["alertname"] == name and a["state"] == "firing"
                and all(a["labels"].get(k) == v for k, v in labels.items())]


@contextlib.contextmanager
def running_prometheus(topology: LocalTopology, d: Path) -> Iterator[Prom]:
    """A real Prometheus scraping ``topology`` with the shipped configuration and rules (scrape
    and evaluation every second), once it has scraped every target successfully."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is missing: `make setup` installs Debian's prometheus package"
    config = d / "prometheus.yml"
    config.write_text(yaml.safe_dump(render(topology.allocator_urls, topology.agent_urls, scrape_interval="1s",
                                            evaluation_interval="1s")))
    targets = len(topology.allocator_urls) + sum(len(urls) for urls in topology.agent_urls.values())
    port = free_port()
    proc = Proc("prometheus", [binary, f"--config.file={config}", f"--storage.tsdb.path={d / 'data'}",
                               f"--web.listen-address={LOOPBACK}:{port}", "--storage.tsdb.retention.time=1h"],
                d, env=dict(os.environ)).start()
    try:
        wait_port(port, proc=proc.popen, timeout=30)
        prom = Prom(f"http://{LOOPBACK}:{port}")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if len([s for s in prom.query("up == 1")]) == targets:
                    break
            except (httpx.HTTPError, AssertionError, KeyError, ValueError):  # ValueError: a starting
                pass  # Prometheus answers its API with a plain-text 503 "Service Unavailable", not JSON
            time.sleep(0.5)
        assert len(prom.query("up == 1")) == targets, prom.query("up")
        yield prom
    finally:
        proc.stop()


class PacedTraffic(Background):
    """Ordinary traffic at a few requests a second per region, in a background thread: birch's
    users read well within their limits (one a second per region: 120 a minute of birch-minute's
    300), one atlas user reads at about 3 a second against read-user-v3's 2 a second refill (so a
    third of atlas's requests are denied ``RATE_EXCEEDED``: a tenant over its quota, the product
    working), and a tenant the bundle does not name asks one forward-auth and one RLS question a
    second. Not a fault in sight."""

    def __init__(self, topo: LocalTopology):
        super().__init__(topo)
        self.statuses: dict[str, int] = {}

    def _count(self, what: str) -> None:
        self.statuses[what] = self.statuses.get(what, 0) + 1

    def _run(self) -> None:
        i = 0
        with self.clients() as (c, stubs, meta):
            while not self.stop.is_set():
                tick = time.monotonic()
                for urls in self.topo.agent_urls.values():
                    url = urls[0]
                    bodies = [{"tenantId": "atlas", "principal": {"type": "user", "id": "U-17"}, "routeGroup": "read"}] * 3
                    bodies += [{"tenantId": "birch", "principal": {"type": "user", "id": f"B-{i % 7}"}, "routeGroup": "read"}]
                    for body in bodies:
                        i += 1
                        r = c.post(url + "/v1/admit", json={"requestId": f"paced-{i:08d}", **body})
                        self._count(f"admit {r.status_code} {r.json().get('httpStatus')}")
                    r = c.get(url + "/v1/authz/catalog", headers={
                        "x-tenant-id": "acme", "x-user-id": f"A-{i % 5}", "x-route-group": "read"})
                    self._count(f"authz {r.status_code}")
                for stub in stubs:
                    res = stub.ShouldRateLimit(rls_pb2.RateLimitRequest(
                        domain="leasehold", descriptors=[descriptor(tenant="acme", user=f"R-{i % 9}", route_group="read")]),
                        metadata=meta, timeout=3)
                    self._count(f"rls {res.overall_code}")
                self.stop.wait(max(0.0, 1.0 - (time.monotonic() - tick)))


def prom_epoch(rfc3339: str) -> float:
    """Prometheus' RFC 3339 time (nanoseconds, ``Z``) as seconds since the epoch."""
    from datetime import datetime

    day, _, frac = rfc3339.rstrip("Z").partition(".")
    return datetime.fromisoformat(day + "+00:00").timestamp() + float("0." + (frac or "0"))


def not_inactive(prom: Prom, ignore: frozenset[str] = frozenset()) -> list[dict]:
    """Every alert pending or firing (``/api/v1/alerts`` lists both), but those in ``ignore``."""
    return [a for a in prom.alerts() if a["labels"]["alertname"] not in ignore]


# The p99 decision latency against its 10 ms threshold measures the machine (two shared cores
# running other tests), not the rule; its silence on a healthy fleet is the promtool cases'.
MACHINE_BOUND = frozenset({"LeaseholdDecisionLatencyHigh"})


def quiet_then_ordinary(topology: LocalTopology, prom: Prom) -> None:
    # the fixture saw every target up; a rule evaluated before those first scrapes rightly found
    # no allocator (LeaseholdAllocatorsAbsent pending for that one evaluation): start from the
    # first evaluation of every group after them
    scraped = time.time()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(
            prom_epoch(g["lastEvaluation"]) > scraped for g in prom.rule_groups()):
        time.sleep(0.5)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # no traffic at all
        assert not not_inactive(prom), not_inactive(prom)
        time.sleep(1)
    with PacedTraffic(topology) as traffic:
        # past the end of a minute window (the demo bundle's windows are aligned to Unix time): its
        # leases end with it, their unspent tokens counted stranded, what a rule once went pending
        # on; then 15 s of evaluations, and at least 45 s of traffic in all (bounded by 100 s)
        started, window_end = time.monotonic(), (time.time() // 60 + 1) * 60
        while time.monotonic() - started < 100:
            assert not not_inactive(prom, MACHINE_BOUND), (not_inactive(prom, MACHINE_BOUND), traffic.statuses)
            if time.time() > window_end + 15 and time.monotonic() - started > 45:
                break
            time.sleep(2)
    # the traffic was what it claims: admissions and RATE_EXCEEDED denials, every door answering
    # (two a second of each door in all, more than one denial a second, for 45 s or more)
    assert traffic.statuses.get("admit 200 200", 0) > 60 and traffic.statuses.get("admit 200 429", 0) > 40, traffic.statuses
    assert traffic.statuses.get("authz 200", 0) > 60 and traffic.statuses.get("rls 1", 0) > 60, traffic.statuses
    assert prom.query(STRANDED), "no lease expired unspent"
    # and Prometheus saw the denials (the counter: a rate over a range longer than the traffic reads low)
    assert prom.query('sum(leasehold_agent_decisions_total{outcome="denied",tenant="atlas"}) > 40')
