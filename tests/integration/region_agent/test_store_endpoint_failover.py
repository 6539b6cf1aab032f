"""A failover behind the Redis endpoint's name, as managed Redis services do it (one DNS name
that moves to the promoted replica, the old primary demoted to a replica of it), on real
servers: the name is a TCP proxy on loopback whose upstream moves, so connections opened
before the failover still reach the demoted node — which answers every write READONLY — and
new ones reach the promoted primary.

What must hold: the agent drops its connections at the first READONLY and reconnects, so a
few decisions degrade, not every decision for as long as the old connections would live."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from litestar.testing import AsyncTestClient

from chaos.proxy import LOOPBACK, FaultProxy
from leasehold.local.procs import RedisServer
from region_agent.service.app import create_app
from tests.support.agent import PEPPER, admit_body, make_settings

pytestmark = pytest.mark.integration


@contextlib.contextmanager
def endpoint(upstream: tuple[str, int]) -> Iterator[FaultProxy]:
    """The proxy on its own event loop and thread (the in-process agent's loop is the test
    client's): setting its ``upstream`` moves where new connections go, as a DNS change would."""
    started = threading.Event()
    box: dict = {}

    async def serve() -> None:
        box["proxy"] = await FaultProxy(upstream).start()
        box["stop"] = asyncio.Event()
        started.set()
        await box["stop"].wait()
        await box["proxy"].stop()

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(10)
    try:
        yield box["proxy"]
    finally:
        loop.call_soon_threadsafe(box["stop"].set)
        thread.join(10)
        loop.close()


async def test_the_agent_follows_a_failover_behind_its_endpoint_name(tmp_path: Path, policy_file: Path):
    old, new = RedisServer(tmp_path / "old").start(), RedisServer(tmp_path / "new").start()
    try:
        new.cli("REPLICAOF", LOOPBACK, str(old.port))
        with endpoint((LOOPBACK, old.port)) as name:
            settings = make_settings(f"redis://{LOOPBACK}:{name.port}/0", policy_file, breaker_open_ms=200)
            async with AsyncTestClient(app=create_app(settings, pepper=PEPPER)) as agent:
                for i in range(20):  # the pool holds connections to the primary
                    d = (await agent.post("/v1/admit", json=admit_body(f"fo-before-{i:04d}", pid=f"b{i}"))).json()
                    assert d["allowed"] and not d["fallback"]
                new.cli("REPLICAOF", "NO", "ONE")  # the failover: the replica is promoted,
                old.cli("REPLICAOF", LOOPBACK, str(new.port))  # the old primary demoted (READONLY)
                name.upstream = (LOOPBACK, new.port)  # and the name moves to the promoted one
                answers = []
                for i in range(60):
                    d = (await agent.post("/v1/admit", json=admit_body(f"fo-after-{i:04d}", pid=f"a{i}"))).json()
                    answers.append(d["fallback"])
                    await asyncio.sleep(0.01)
                # the first READONLY drops the pool; the next connection reaches the promoted primary
                assert sum(answers) <= 3, answers
                assert not any(answers[-50:]), answers
                assert int(new.cli("DBSIZE")) > 0  # decided there
    finally:
        old.stop()
        new.stop()
