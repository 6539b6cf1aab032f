"""Figure 8: the gateway path.

* RLS decisions/s through gRPC: ``ShouldRateLimit`` against the agent's RLS port (one channel,
  64 in flight, 10k users of a tenant with only the P-READ user rule) vs a bare grpcio server
  answering a constant ``OK`` (``rls_bare``), one process each, same load generator; p50/p99.
* End to end through Envoy (``deploy/gateways/envoy-rls.yaml``, 1 worker) in front of the demo
  upstream, 64 keep-alive connections from 64 loopback addresses, each request with a verified
  bearer token: with the rate limit filter (RLS to the agent: the address window, then the
  user's rule) vs the same config with the filter removed (jwt_authn verifies either way).
* The two HTTP checks through their real gateways, each against the same gateway with no check:
  Envoy with ``envoy.filters.http.ext_authz`` -> the agent's ``/v1/authz``
  (``deploy/gateways/envoy-ext-authz.yaml``) vs that config without the filter, and nginx
  ``auth_request`` -> ``/v1/authz`` (``deploy/gateways/nginx.conf``, the agent verifying the
  bearer token) vs that config without its ``auth_request`` lines; same clients and tokens.
* Through Envoy with the rate limit quota filter (``deploy/gateways/envoy-rlqs.yaml``, RLQS:
  Envoy decides locally from assignments the agent funds) vs that config with its limit filters
  removed (goal >= 0.90), after a warm-up pass that makes the principals' buckets; the agent's CPU
  per admitted request against RLS's; and utilisation: one user (P-READ's rule, 20 then 2/s)
  asked far past its limit, admitted / (20 + 2/s x the measured span) (goal >= 0.95; RLS alongside).
  RLQS's Envoys talk to an agent of their own (its buckets' reports and funding rounds run for the
  whole figure and would otherwise load the agent the RLS rows measure).

Each ratio's two servers run one after the other in every trial, in the opposite order every
other trial. Each gateway row reports the CPU per request of every process on its path (the agent, the
gateway, the upstream, Redis, the load generator) and how busy the machine was: what bounds the
row on a given machine."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import yaml

from leasehold.local.devjwt import DevIssuer
from leasehold.local.gateways import Envoy, Nginx, render, tracing_values, upstream
from leasehold.local.procs import LOOPBACK, Proc, RedisServer, free_port, wait_port

from .context import Ctx
from .harness import REPO, CpuMeter, _env, degraded_counts, delta, redis_client, services, start_agent
from .stats import Goal, Row, median

CONNS = 64
SOURCES = [f"127.0.3.{i}" for i in range(1, CONNS + 1)]


def gwload(cfg: dict) -> dict:
    limit = cfg["duration_s"] + cfg.get("warmup_s", 0) + 30
    out = subprocess.run([sys.executable, "-m", "bench.gwload", json.dumps(cfg)], capture_output=True,
                         text=True, timeout=limit, env=_env(), cwd=REPO)
    if out.returncode != 0:
        raise RuntimeError(f"gateway load generator failed ({out.returncode}):\n{out.stderr[-2000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    if not res["ok"]:
        raise RuntimeError(f"no OK answer from {cfg.get('name', cfg['mode'])}: {res['statuses']} {res['error_samples']}")
    return res


RLQS_OFF = ("ratelimit", "rate_limit_quota")  # envoy-rlqs.yaml's limit filters (RLS for the unidentified, RLQS)
UTIL_CONNS = 8
WARM_S = 8.0
UTIL_S = 10.0  # two of Envoy's 5 s report intervals: a bucket's assignments follow its reported demand


def filter_off(config: str, name: str = "envoy.filters.http.ratelimit") -> str:
    """The same Envoy config without the HTTP filter ``name`` (and the rate limit's 503 mapper)."""
    doc = yaml.safe_load(config)
    for listener in doc["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                hcm = f["typed_config"]
                hcm["http_filters"] = [h for h in hcm["http_filters"] if h["name"] != name]
                if name == "envoy.filters.http.ratelimit":
                    hcm.pop("local_reply_config", None)
    return yaml.safe_dump(doc)


_AUTH_REQUEST = re.compile(r"^\s*auth_request\s.*\n", re.M)
_AUTH_REQUEST_SET = re.compile(r"^(\s*)auth_request_set\s+(\$\w+)\s.*$", re.M)


def auth_request_off(config: str) -> str:
    """The same nginx config without its ``auth_request`` (each ``auth_request_set`` variable
    set to the empty string instead, so the rest of the file is unchanged)."""
    out = _AUTH_REQUEST_SET.sub(r'\1set \2 "";', _AUTH_REQUEST.sub("", config))
    if re.search(r"^\s*auth_request", out, re.M):
        raise ValueError("nginx.conf: an auth_request directive the bench cannot remove")
    return out


def run(ctx: Ctx) -> list[Row]:
    w = ctx.work
    redis = RedisServer(w / "fig8-redis").start()
    with services(redis):
        rls_port, bare_port = free_port(), free_port()
        issuer = DevIssuer()
        jwks = issuer.write_jwks(w / "fig8-jwks.json")
        agent = start_agent(w / "fig8-agent", redis.url, extra=["--rls-port", str(rls_port), *ctx.agent_args])
        # nginx's agent: the identity flags nginx.conf names (it verifies the client's bearer token
        # itself, where Envoy's jwt_authn does it for the other doors), on the same Redis
        jwt = ["--authz-jwks", str(jwks), "--authz-jwt-issuer", issuer.issuer, "--authz-jwt-audience", issuer.audience,
               "--authz-anonymous-routes", "login"]
        agent_jwt = start_agent(w / "fig8-agent-jwt", redis.url, region="bench-jwt", extra=[*jwt, *ctx.agent_args])
        # RLQS's Envoys get an agent of their own: their buckets' usage reports and funding rounds go on
        # for the whole run (every 5 s per bucket, thousands of buckets after the warm-up) and would
        # load the agent the RLS and ext_authz rows measure
        rlqs_port = free_port()
        agent_rlqs = start_agent(w / "fig8-agent-rlqs", redis.url, region="bench-rlqs",
                                 extra=["--rls-port", str(rlqs_port), *ctx.agent_args])
        with services(agent, agent_jwt, agent_rlqs):
            wait_port(rls_port, proc=agent.proc.popen, timeout=30)
            wait_port(rlqs_port, proc=agent_rlqs.proc.popen, timeout=30)
            bare = Proc("rls-bare", [sys.executable, "-m", "bench.rls_bare", "--port", str(bare_port)],
                        w / "fig8-bare", env=_env()).start()
            up, up_port = upstream(w / "fig8-upstream")
            tokens = w / "fig8-tokens.txt"
            tokens.write_text("".join(f"Bearer {issuer.token(f'U-{i}', 'bench')}\n" for i in range(ctx.principals)))
            values = {"ENVOY_LISTEN_HOST": LOOPBACK, "AGENT_HOST": LOOPBACK, "AGENT_RLS_PORT": rls_port,
                      "AGENT_HTTP_PORT": agent.port, "NGINX_LISTEN_HOST": LOOPBACK,
                      "UPSTREAM_HOST": LOOPBACK, "UPSTREAM_PORT": up_port, "GATEWAY_TOKEN": "auth-disabled",
                      **issuer.values(jwks), **tracing_values()}
            gws: list = []
            try:
                wait_port(bare_port, proc=bare.popen, timeout=30)
                envoys = {"envoy_rls": ("envoy-rls.yaml", None), "envoy_off": ("envoy-rls.yaml", "ratelimit"),
                          "authz_envoy": ("envoy-ext-authz.yaml", None),
                          "authz_envoy_off": ("envoy-ext-authz.yaml", "ext_authz"),
                          "envoy_rlqs": ("envoy-rlqs.yaml", None), "envoy_rlqs_off": ("envoy-rlqs.yaml", RLQS_OFF)}
                ports = {}
                for name, (template, off) in envoys.items():
                    port, admin = free_port(), free_port()
                    own = ({"AGENT_RLS_PORT": rlqs_port, "AGENT_HTTP_PORT": agent_rlqs.port}
                           if name.startswith("envoy_rlqs") else {})
                    cfg = render(template, ENVOY_PORT=port, ENVOY_ADMIN_PORT=admin,
                                 ENVOY_ACCESS_LOG=w / f"fig8-{name}" / "access.log", **{**values, **own})
                    for f in (off,) if isinstance(off, str) else off or ():
                        cfg = filter_off(cfg, f"envoy.filters.http.{f}")
                    gws.append(Envoy(name, cfg, w / f"fig8-{name}", port, admin).start())
                    ports[name] = port
                for name in ("nginx", "nginx_off"):
                    port = free_port()
                    cfg = render("nginx.conf", NGINX_PORT=port, **{**values, "AGENT_HTTP_PORT": agent_jwt.port})
                    gws.append(Nginx(name, cfg if name == "nginx" else auth_request_off(cfg), w / f"fig8-{name}",
                                     port).start())
                    ports[name] = port
                rows = _measure(ctx, agent, redis, {"agent": rls_port, "bare": bare_port}, ports, up.pid, tokens,
                                {"nginx": agent_jwt.proc.pid, "nginx_off": agent_jwt.proc.pid,
                                 "envoy_rlqs": agent_rlqs.proc.pid, "envoy_rlqs_off": agent_rlqs.proc.pid},
                                {g.name: g.proc.pid for g in gws if g.proc is not None}, bare.pid)
                return rows + _utilisation(agent_rlqs, {k: ports[k] for k in ("envoy_rls", "envoy_rlqs")}, issuer,
                                           w / "fig8-util-tokens.txt")
            finally:
                for g in gws:
                    g.stop()
                up.stop()
                bare.stop()


def _alternated(ports: dict[str, int], trial: int) -> list[tuple[str, int]]:
    """The servers of a set of rows in their order in even trials, reversed in odd ones."""
    items = list(ports.items())
    return items if trial % 2 == 0 else items[::-1]


def _measure(ctx: Ctx, agent, redis, rls_ports: dict[str, int], http_ports: dict[str, int], up_pid: int,
             tokens, agent_pids: dict[str, int], gateway_pids: dict[str, int] | None = None,
             bare_pid: int | None = None) -> list[Row]:
    """``gateway_pids``: each gateway's process (its CPU per request is reported with the agent's,
    the upstream's, Redis's and the load generator's: what bounds each row on a given machine)."""
    r = redis_client(redis)
    base = {"conns": CONNS, "duration_s": ctx.duration_s, "warmup_s": ctx.warmup_s, "principals": ctx.principals,
            "tenant": "bench", "max_requests": 2_000_000}
    res: dict[str, list[dict]] = {k: [] for k in (*rls_ports, *http_ports)}
    before = degraded_counts(agent)
    warm = {}
    if "envoy_rlqs" in http_ports:  # every principal's bucket once (its first request is denied: no assignment yet)
        warm = _warm(base, http_ports["envoy_rlqs"], tokens, ctx.principals)
    for t in range(ctx.trials):
        # each row's servers in the opposite order every other trial (as bench.rls_ab alternates), so
        # that neither side of a ratio always runs first after the set-up or the previous rows
        for name, port in _alternated(rls_ports, t):
            pids = {"agent": agent.proc.pid} if name == "agent" else {"bare": bare_pid} if bare_pid else {}
            d0 = degraded_counts(agent)
            with CpuMeter(pids, r if name == "agent" else None) as meter:
                out = gwload({**base, "mode": "rls", "port": port, "tenant": f"bench{t}"})
            out["agent_degraded"] = delta(degraded_counts(agent), d0)
            out["cpu_us_per_call"] = meter.per(out["sent"])
            out["machine_cores"] = meter.machine_cores
            res[name].append(out)
        for name, port in _alternated(http_ports, t):
            pids = {"agent": agent_pids.get(name, agent.proc.pid), "upstream": up_pid}
            if gateway_pids and name in gateway_pids:
                pids["gateway"] = gateway_pids[name]
            d0 = degraded_counts(agent)
            with CpuMeter(pids, r) as meter:
                out = gwload({**base, "mode": "http", "port": port, "tokens_file": str(tokens), "sources": SOURCES,
                              "name": name})
            out["agent_degraded"] = delta(degraded_counts(agent), d0)  # the RLS agent's local fallbacks in this row
            out["cpu_us_per_request"] = meter.per(out["sent"])
            if out["sent"]:
                out["cpu_us_per_request"]["loadgen"] = 1e6 * out["cpu_s"] / out["sent"]
            out["machine_cores"] = meter.machine_cores
            out["agent_cpu_us_per_admitted"] = meter.per(out["ok"]).get("agent")
            res[name].append(out)
    r.close()
    degraded = delta(degraded_counts(agent), before)
    if degraded:
        ctx.note(f"fig8: the agent made degraded (local fallback) decisions under load: {degraded}")

    def med(name: str, key: str) -> float:
        return median(x[key] for x in res[name])

    extra = {"conns": CONNS, "trials": {k: [{"rps": x["rps"], "p50_ms": x["p50_ms"], "p99_ms": x["p99_ms"],
                                              "statuses": x["statuses"], "loadgen_cpu_pct": x["cpu_pct"],
                                              "machine_cores": x.get("machine_cores"),
                                              "agent_degraded": x.get("agent_degraded")} for x in v]
                                         for k, v in res.items()},
             "agent_cpu_us_per_rls_call": [x["cpu_us_per_call"] for x in res["agent"]],
             "bare_cpu_us_per_rls_call": [x["cpu_us_per_call"] for x in res["bare"]],
             "cpu_us_per_envoy_request": {k: [x["cpu_us_per_request"] for x in res[k]] for k in http_ports},
             "agent_degraded": degraded, "rlqs_warmup": warm}
    return [
        Row("8", f"RLS ShouldRateLimit via gRPC, {CONNS} in flight: throughput", med("agent", "rps"), "calls/s",
            med("bare", "rps"), "bare grpcio constant OK", Goal(">=", 0.85), extra=extra),
        Row("8", f"RLS via gRPC, {CONNS} in flight: p50 latency", med("agent", "p50_ms"), "ms", med("bare", "p50_ms"),
            "bare grpcio constant OK", Goal("<=", 1.3)),
        Row("8", f"RLS via gRPC, {CONNS} in flight: p99 latency", med("agent", "p99_ms"), "ms", med("bare", "p99_ms"),
            "bare grpcio constant OK"),
        Row("8", f"through Envoy + rate limit filter, {CONNS} conns: throughput", med("envoy_rls", "rps"), "req/s",
            med("envoy_off", "rps"), "Envoy, filter off", Goal(">=", 0.30)),
        Row("8", f"through Envoy + rate limit filter, {CONNS} conns: p50 latency", med("envoy_rls", "p50_ms"), "ms",
            med("envoy_off", "p50_ms"), "Envoy, filter off"),
        Row("8", f"through Envoy + rate limit filter, {CONNS} conns: p99 latency", med("envoy_rls", "p99_ms"), "ms",
            med("envoy_off", "p99_ms"), "Envoy, filter off"),
        *(Row("8", f"through {label}, {CONNS} conns: {what}", med(name, key), unit, med(f"{name}_off", key), off)
          for name, label, off in (("authz_envoy", "Envoy + ext_authz (HTTP)", "Envoy, ext_authz off"),
                                   ("nginx", "nginx + auth_request", "nginx, auth_request off"))
          for what, key, unit in (("throughput", "rps", "req/s"), ("p50 latency", "p50_ms", "ms"),
                                  ("p99 latency", "p99_ms", "ms"))),
        Row("8", f"through Envoy + rate limit quota filter (RLQS), {CONNS} conns: throughput",
            med("envoy_rlqs", "rps"), "req/s", med("envoy_rlqs_off", "rps"), "Envoy, limit filters off",
            Goal(">=", 0.90),
            extra={"agent_cpu_us_per_admitted": {k: [x["agent_cpu_us_per_admitted"] for x in res[k]]
                                                 for k in ("envoy_rls", "envoy_rlqs")}}),
        Row("8", f"through Envoy + RLQS, {CONNS} conns: p50 latency", med("envoy_rlqs", "p50_ms"), "ms",
            med("envoy_rlqs_off", "p50_ms"), "Envoy, limit filters off"),
        Row("8", "agent CPU per admitted request: RLQS", med("envoy_rlqs", "agent_cpu_us_per_admitted"), "us",
            med("envoy_rls", "agent_cpu_us_per_admitted"), "RLS"),
    ]


def _warm(base: dict, port: int, tokens, principals: int) -> dict:
    """Envoy's RLQS buckets of the run's principals, made before the trials: a pass over them, then
    long enough for Envoy's next usage report (every 5 s) to size their assignments."""
    cfg = {**base, "mode": "http", "port": port, "tokens_file": str(tokens), "sources": SOURCES, "warmup_s": 0.0,
           "duration_s": WARM_S, "name": "envoy_rlqs warm-up"}
    try:
        out = gwload(cfg)
    except RuntimeError as e:  # no OK answer in the warm-up (every request a bucket's first): the trials show it
        return {"error": str(e)[:500]}
    return {"statuses": out["statuses"], "requests": out["requests"], "principals": principals}


def _utilisation(agent, ports: dict[str, int], issuer: DevIssuer, tokens) -> list[Row]:
    """One user per Envoy (a fresh bucket: 20 tokens, then 2/s), asked by UTIL_CONNS connections for
    UTIL_S seconds: admitted / (20 + 2 x the measured span). ``agent``: RLQS's (its token metrics)."""
    util: dict[str, float] = {}
    extra: dict[str, dict] = {}
    for name, port in ports.items():
        tokens.write_text(f"Bearer {issuer.token(f'U-util-{name}', 'bench')}\n")
        out = gwload({"mode": "http", "port": port, "conns": UTIL_CONNS, "duration_s": UTIL_S, "warmup_s": 0.0,
                      "principals": 1, "tokens_file": str(tokens), "sources": SOURCES[:UTIL_CONNS],
                      "max_requests": 2_000_000, "name": f"{name} utilisation"})
        limit = 20 + 2 * out["elapsed_s"]
        util[name] = out["ok"] / limit
        extra[name] = {"admitted": out["ok"], "limit": limit, "statuses": out["statuses"]}
    stranded = _metric(agent, "leasehold_agent_rlqs_stranded_tokens_total")
    assigned = _metric(agent, "leasehold_agent_rlqs_assigned_tokens_total")
    return [Row("8", f"utilisation of one user's limit, demand far above it ({UTIL_S:.0f} s): RLQS",
                util["envoy_rlqs"], "of limit", None, "", Goal(">=", 0.95),
                extra={**extra, "rls_utilisation": util["envoy_rls"], "rlqs_assigned_tokens": assigned,
                       "rlqs_stranded_tokens": stranded})]


def _metric(svc, name: str) -> float:
    import httpx

    total = 0.0
    for line in httpx.get(svc.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rpartition(" ")[2])
    return total
