"""A burst on a healthy agent (docs/concepts.md: overload is shed): Redis is up and answering, so no decision may
come from the local fallback allowances (they are part of the overshoot bound, and answering from
them would deny with the fallback's small numbers). What overload may do instead: queue within the
decision budget, or shed with a clear, retriable answer (503 ``OVERLOADED``, ``Retry-After``), and
count it. A real agent process (uvicorn) and a real redis-server."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import httpx

from tests.support.agent import admit_body, agent_process


def _check(ds: list[dict]) -> tuple[int, int]:
    fallback = [d for d in ds if d["fallback"]]
    assert not fallback, f"{len(fallback)} of {len(ds)} decisions from the fallback allowances: {fallback[0]}"
    shed = [d for d in ds if d.get("reason") == "OVERLOADED"]
    for d in shed:
        assert d["httpStatus"] == 503 and not d["allowed"] and int(d["headers"]["Retry-After"]) >= 1, d
    for d in ds:
        if not d["allowed"] and d.get("reason") != "OVERLOADED":
            assert d["httpStatus"] == 429 and d["reason"] in ("RATE_EXCEEDED", "CONCURRENCY_EXCEEDED"), d
    return sum(d["allowed"] for d in ds), len(shed)


async def test_a_burst_never_spends_fallback_allowances(redis_url: str, policy_file: Path, tmp_path: Path):
    with agent_process(tmp_path / "agent", redis_url, policy_file) as (base, _proc):
        limits = httpx.Limits(max_connections=500, max_keepalive_connections=500)
        async with httpx.AsyncClient(timeout=30, limits=limits) as client:
            async def one(i: int) -> dict:
                resp = await client.post(base + "/v1/admit", json=admit_body(
                    f"burst-{uuid.uuid4().hex[:16]}", pid=f"U-{i % 200}", tenant=f"t{i % 20}"))
                assert resp.status_code == 200, resp.text
                return resp.json()

            singles = await asyncio.gather(*(one(i) for i in range(500)))
            allowed, shed = _check(singles)
            assert allowed > 0

            async def batch(j: int) -> list[dict]:
                reqs = [admit_body(f"b{j}-{uuid.uuid4().hex[:16]}", pid=f"U-{i % 300}", tenant=f"t{i % 30}")
                        for i in range(1_000)]
                resp = await client.post(base + "/v1/admit/batch", json={"requests": reqs})
                assert resp.status_code == 200, resp.text
                return resp.json()["decisions"]

            batches = await asyncio.gather(*(batch(j) for j in range(6)))
            b_allowed, b_shed = _check([d for ds in batches for d in ds])
            assert b_allowed > 0
            metrics = (await client.get(base + "/metrics")).text
    fb_metric = [line for line in metrics.splitlines()
                 if line.startswith("leasehold_agent_degraded_decisions_total{") and not line.endswith(" 0.0")]
    assert not fb_metric, fb_metric
    if shed + b_shed:  # shedding is counted
        assert any(line.startswith("leasehold_agent_shed_total") and not line.endswith(" 0.0")
                   for line in metrics.splitlines())
