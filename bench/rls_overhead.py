"""What the agent adds to an RLS call beyond the decision, without the gRPC transport: in one
process, against a real redis-server, 64 tasks call either the engine with the question itself
(``engine.admit``, the decision alone) or the RLS servicer with the protobuf request
(``RateLimitServicer.ShouldRateLimit``: descriptor mapping, the admission's pre-checks, the
decision, the protobuf answer, the door's metrics), each call alone or, as in the agent, calls
that arrive together decided together (``--rls-group-linger-ms`` 2) — alternated, ``--rounds`` times; process CPU
per call of each (``getrusage``). The difference is the door's own work; gRPC's is figure 8's
bare constant-OK server.

    python -m bench.rls_overhead [--rounds 5] [--seconds 2]"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2
from prometheus_client import CollectorRegistry

from leasehold.local.procs import RedisServer
from region_agent.decision.admission import Admission
from region_agent.gateways.mapping import Names
from region_agent.gateways.metrics import GatewayMetrics
from region_agent.gateways.rls import RateLimitServicer
from region_agent.models import AdmitRequest, Principal

from .fig_library import make_engine
from .harness import drive, services
from .stats import median

TASKS = int(os.environ.get("RLS_OVERHEAD_TASKS", "64"))
USERS = 10_000


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class _Context:
    """What the servicer asks of grpc's ServicerContext on the answered path."""

    def invocation_metadata(self):
        return ()


def _requests(tag: str) -> list[bytes]:
    """The calls' bytes, as grpcio hands them to the servicer."""
    D = ratelimit_pb2.RateLimitDescriptor
    return [rls_pb2.RateLimitRequest(domain="leasehold", descriptors=[D(entries=[
        D.Entry(key="tenant", value=tag), D.Entry(key="user", value=f"U-{i}"),
        D.Entry(key="route_group", value="read")])]).SerializeToString() for i in range(USERS)]


async def _rounds(redis_url: str, rounds: int, seconds: float) -> dict[str, list[float]]:
    engine, store = await make_engine(redis_url)
    engine.budget = 1.0  # the door is measured, not the machine: no decision degrades on a busy machine
    snap = engine.get_snapshot()
    holder = SimpleNamespace(bundle=snap.bundle, snapshot=snap)
    st = SimpleNamespace(engine=engine, holder=holder, policy_watch=None, version_check=None, key_cap=None)
    admission = Admission(lambda: st)
    servicer = RateLimitServicer(names=Names.build(), decide=admission.decide, decide_one=admission.decide_one,
                                 snapshot_of=lambda: st.holder.snapshot,
                                 gateways=None, metrics=GatewayMetrics(CollectorRegistry()))
    # the agent's servicer: calls that arrive while others are in flight decided together (2 ms)
    grouped = RateLimitServicer(names=Names.build(), decide=admission.decide, decide_one=admission.decide_one,
                                 snapshot_of=lambda: st.holder.snapshot,
                                gateways=None, metrics=GatewayMetrics(CollectorRegistry()), group_linger_s=0.002)
    ctx = _Context()
    out: dict[str, list[float]] = {"decision": [], "rls_servicer": [], "rls_grouped": []}
    try:
        for t in range(rounds):
            questions = [AdmitRequest(request_id=f"o{t}-{i:010d}", principal=Principal(type="user", id=f"U-{i}"),
                                      route_group="read", tenant_id=f"d{t}") for i in range(USERS)]
            reqs, greqs = _requests(f"r{t}"), _requests(f"g{t}")
            for name, op in (("decision", lambda i, q=questions: engine.admit(q[(i * 7919) % USERS])),
                             ("rls_servicer", lambda i, r=reqs: servicer.ShouldRateLimit(r[(i * 7919) % USERS], ctx)),
                             ("rls_grouped", lambda i, r=greqs: grouped.ShouldRateLimit(r[(i * 7919) % USERS], ctx))):
                c0 = _cpu()
                done, _secs = await drive(op, concurrency=TASKS, duration_s=seconds, max_ops=USERS * 50)
                out[name].append(1e6 * (_cpu() - c0) / done)
    finally:
        await store.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.rls_overhead")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=2.0)
    a = ap.parse_args(argv)
    import uvloop

    with tempfile.TemporaryDirectory(prefix="leasehold-rls-overhead-") as tmp:
        redis = RedisServer(Path(tmp) / "redis").start()
        with services(redis):
            res = uvloop.run(_rounds(redis.url, a.rounds, a.seconds))
    for k, v in res.items():
        print(f"{k:14s} {median(v):6.1f} us CPU per call (median; trials {', '.join(f'{x:.1f}' for x in v)})")
    print(f"the door's own work: {median(res['rls_servicer']) - median(res['decision']):.1f} us per call "
          f"(calls decided together: {median(res['rls_grouped']) - median(res['decision']):.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
