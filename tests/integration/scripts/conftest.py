"""Clients for the script tests: every test runs against a real standalone redis-server AND a
real 3-master Redis Cluster (the shared session fixtures, flushed per test)."""

from __future__ import annotations

import pytest
import redis
import redis.asyncio as aredis

from .support import ScriptCalls

pytestmark = pytest.mark.integration

TOPOLOGIES = ["standalone", "cluster"]


def _url(request: pytest.FixtureRequest) -> str:
    name = "redis_url" if request.param == "standalone" else "redis_cluster_url"
    return request.getfixturevalue(name)


@pytest.fixture(scope="session")
def scripts() -> ScriptCalls:
    return ScriptCalls()


@pytest.fixture(params=TOPOLOGIES)
async def aclient(request: pytest.FixtureRequest, scripts: ScriptCalls):
    url = _url(request)
    c = aredis.RedisCluster.from_url(url) if request.param == "cluster" else aredis.Redis.from_url(url)
    # FLUSHALL keeps the script cache: one SCRIPT EXISTS (every primary's answer and-ed) instead of
    # a SCRIPT LOAD per script and primary before each of ~1,000 cases; anything missing, all loaded
    if not all(await c.script_exists(*(s.sha for s in scripts.scripts.values()))):
        await scripts.load_all(c)
    yield c
    await c.aclose()


@pytest.fixture(params=TOPOLOGIES)
def sclient(request: pytest.FixtureRequest, scripts: ScriptCalls):
    """A synchronous client (for the hypothesis differential tests), scripts loaded."""
    url = _url(request)
    c = redis.RedisCluster.from_url(url) if request.param == "cluster" else redis.Redis.from_url(url)
    if not all(c.script_exists(*(s.sha for s in scripts.scripts.values()))):
        for name in scripts.scripts:
            c.script_load(scripts.source(name))
    yield c
    c.close()
