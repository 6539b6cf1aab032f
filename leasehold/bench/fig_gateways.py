"""Figure 8: the gateway path.

* RLS decisions/s through gRPC: ``ShouldRateLimit`` against the agent's RLS port (one channel,
  64 in flight, 10k users of a tenant with only the P-READ user rule) vs a bare grpcio server
  answering a constant ``OK`` (``rls_bare``), one process each, same load generator; p50/p99.
* End to end through Envoy (``deploy/gateways/envoy-rls.yaml``, 1 worker) in front of the demo
  upstream, 64 keep-alive connections from 64 loopback addresses, each request with a verified
  bearer token: with the rate limit filter (RLS to the agent: the address window, then the
  user's rule) vs the same config with the filter removed (jwt_authn verifies either way)."""

from __future__ import annotations

import json
import subprocess
import sys

import yaml

from leasehold.devjwt import DevIssuer
from leasehold.gateways import Envoy, render, tracing_values, upstream
from leasehold.procs import LOOPBACK, Proc, RedisServer, free_port, wait_port

from .context import Ctx
from .harness import REPO, CpuMeter, _env, degraded_counts, delta, redis_client, services, start_agent
from .stats import Row, median

CONNS = 64
SOURCES = [f"127.0.3.{i}" for i in range(1, CONNS + 1)]


def gwload(cfg: dict) -> dict:
    limit = cfg["duration_s"] + cfg.get("warmup_s", 0) + 30
    out = subprocess.run([sys.executable, "-m", "leasehold.bench.gwload", json.dumps(cfg)], capture_output=True,
                         text=True, timeout=limit, env=_env(), cwd=REPO)
    if out.returncode != 0:
        raise RuntimeError(f"gateway load generator failed ({out.returncode}):\n{out.stderr[-2000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    if not res["ok"]:
        raise RuntimeError(f"no OK answer: {res['statuses']} {res['error_samples']}")
    return res


def filter_off(config: str) -> str:
    """The same Envoy config without envoy.filters.http.ratelimit (and its 503 mapper)."""
    doc = yaml.safe_load(config)
    for listener in doc["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                hcm = f["typed_config"]
                hcm["http_filters"] = [h for h in hcm["http_filters"] if h["name"] != "envoy.filters.http.ratelimit"]
                hcm.pop("local_reply_config", None)
    return yaml.safe_dump(doc)


def run(ctx: Ctx) -> list[Row]:
    w = ctx.work
    redis = RedisServer(w / "fig8-redis").start()
    with services(redis):
        rls_port, bare_port = free_port(), free_port()
        agent = start_agent(w / "fig8-agent", redis.url, extra=["--rls-port", str(rls_port), *ctx.agent_args])
        with services(agent):
            wait_port(rls_port, proc=agent.proc.popen, timeout=30)
            bare = Proc("rls-bare", [sys.executable, "-m", "leasehold.bench.rls_bare", "--port", str(bare_port)],
                        w / "fig8-bare", env=_env()).start()
            up, up_port = upstream(w / "fig8-upstream")
            issuer = DevIssuer()
            tokens = w / "fig8-tokens.txt"
            tokens.write_text("".join(f"Bearer {issuer.token(f'U-{i}', 'bench')}\n" for i in range(ctx.principals)))
            values = {"ENVOY_LISTEN_HOST": LOOPBACK, "AGENT_HOST": LOOPBACK, "AGENT_RLS_PORT": rls_port,
                      "UPSTREAM_HOST": LOOPBACK, "UPSTREAM_PORT": up_port, "GATEWAY_TOKEN": "auth-disabled",
                      **issuer.values(issuer.write_jwks(w / "fig8-jwks.json")), **tracing_values()}
            envoys = {}
            try:
                wait_port(bare_port, proc=bare.popen, timeout=30)
                for name in ("envoy_rls", "envoy_off"):
                    port, admin = free_port(), free_port()
                    cfg = render("envoy-rls.yaml", ENVOY_PORT=port, ENVOY_ADMIN_PORT=admin, **values)
                    envoys[name] = Envoy(name, cfg if name == "envoy_rls" else filter_off(cfg), w / f"fig8-{name}",
                                         port, admin).start()
                return _measure(ctx, agent, redis, {"agent": rls_port, "bare": bare_port},
                                {k: e.port for k, e in envoys.items()}, up.pid, tokens)
            finally:
                for e in envoys.values():
                    e.stop()
                up.stop()
                bare.stop()


def _measure(ctx: Ctx, agent, redis, rls_ports: dict[str, int], http_ports: dict[str, int], up_pid: int,
             tokens) -> list[Row]:
    r = redis_client(redis)
    base = {"conns": CONNS, "duration_s": ctx.duration_s, "warmup_s": ctx.warmup_s, "principals": ctx.principals,
            "tenant": "bench", "max_requests": 2_000_000}
    res: dict[str, list[dict]] = {k: [] for k in (*rls_ports, *http_ports)}
    before = degraded_counts(agent)
    for t in range(ctx.trials):
        for name, port in rls_ports.items():
            pids = {"agent": agent.proc.pid} if name == "agent" else {}
            with CpuMeter(pids, r if name == "agent" else None) as meter:
                out = gwload({**base, "mode": "rls", "port": port, "tenant": f"bench{t}"})
            out["cpu_us_per_call"] = meter.per(out["sent"])
            res[name].append(out)
        for name, port in http_ports.items():
            with CpuMeter({"agent": agent.proc.pid, "upstream": up_pid}, r) as meter:
                out = gwload({**base, "mode": "http", "port": port, "tokens_file": str(tokens), "sources": SOURCES})
            out["cpu_us_per_request"] = meter.per(out["sent"])
            res[name].append(out)
    r.close()
    degraded = delta(degraded_counts(agent), before)
    if degraded:
        ctx.note(f"fig8: the agent made degraded (local fallback) decisions under load: {degraded}")

    def med(name: str, key: str) -> float:
        return median(x[key] for x in res[name])

    extra = {"conns": CONNS, "trials": {k: [{"rps": x["rps"], "p50_ms": x["p50_ms"], "p99_ms": x["p99_ms"],
                                              "statuses": x["statuses"], "loadgen_cpu_pct": x["cpu_pct"]} for x in v]
                                         for k, v in res.items()},
             "agent_cpu_us_per_rls_call": [x["cpu_us_per_call"] for x in res["agent"]],
             "cpu_us_per_envoy_request": {k: [x["cpu_us_per_request"] for x in res[k]] for k in http_ports},
             "agent_degraded": degraded}
    return [
        Row("8", f"RLS ShouldRateLimit via gRPC, {CONNS} in flight: throughput", med("agent", "rps"), "calls/s",
            med("bare", "rps"), "bare grpcio constant OK", extra=extra),
        Row("8", f"RLS via gRPC, {CONNS} in flight: p50 latency", med("agent", "p50_ms"), "ms", med("bare", "p50_ms"),
            "bare grpcio constant OK"),
        Row("8", f"RLS via gRPC, {CONNS} in flight: p99 latency", med("agent", "p99_ms"), "ms", med("bare", "p99_ms"),
            "bare grpcio constant OK"),
        Row("8", f"through Envoy + rate limit filter, {CONNS} conns: throughput", med("envoy_rls", "rps"), "req/s",
            med("envoy_off", "rps"), "Envoy, filter off"),
        Row("8", f"through Envoy + rate limit filter, {CONNS} conns: p50 latency", med("envoy_rls", "p50_ms"), "ms",
            med("envoy_off", "p50_ms"), "Envoy, filter off"),
        Row("8", f"through Envoy + rate limit filter, {CONNS} conns: p99 latency", med("envoy_rls", "p99_ms"), "ms",
            med("envoy_off", "p99_ms"), "Envoy, filter off"),
    ]
