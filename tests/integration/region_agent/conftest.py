"""Agent fixtures against the real Redis fixtures: the Litestar app in-process (requests run one
at a time through the test client's portal), on a standalone Redis or a Redis Cluster. What the
tests share besides fixtures is in tests/support/: the settings, the agent as a real uvicorn
process and the admission bodies (``agent.py``), the stored buckets (``redis_buckets.py``), the
sample bundle (``policies.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import NamedTuple

import pytest
from litestar.testing import AsyncTestClient
from redis.asyncio import Redis, RedisCluster

from region_agent.service.app import create_app
from tests.support.agent import PEPPER, make_settings


@pytest.fixture
async def agent(redis_url: str, policy_file: Path) -> AsyncIterator[AsyncTestClient]:
    app = create_app(make_settings(redis_url, policy_file), pepper=PEPPER)
    async with AsyncTestClient(app=app) as client:
        yield client


@pytest.fixture
async def cluster_agent(redis_cluster_url: str, policy_file: Path) -> AsyncIterator[AsyncTestClient]:
    url = redis_cluster_url.replace("redis://", "redis+cluster://")
    app = create_app(make_settings(url, policy_file), pepper=PEPPER)
    async with AsyncTestClient(app=app) as client:
        yield client


class Topology(NamedTuple):
    name: str  # "standalone" | "cluster"
    url: str  # for the test's own client
    agent_url: str  # what the agent is given


@pytest.fixture(params=["standalone", "cluster"])
def topology(request: pytest.FixtureRequest) -> Topology:
    """The behaviour suites (test_worked_numbers.py, test_algorithms_http.py) run on a standalone
    Redis and on a 3-master Redis Cluster: the agent's HTTP path, not only the scripts."""
    if request.param == "cluster":
        url = request.getfixturevalue("redis_cluster_url")
        return Topology("cluster", url, url.replace("redis://", "redis+cluster://"))
    url = request.getfixturevalue("redis_url")
    return Topology("standalone", url, url)


@pytest.fixture
async def store_client(topology: Topology) -> AsyncIterator[Redis | RedisCluster]:
    """The test's own client of the topology's Redis (to read and set stored state)."""
    client = RedisCluster.from_url(topology.url) if topology.name == "cluster" else Redis.from_url(topology.url)
    yield client
    await client.aclose()
