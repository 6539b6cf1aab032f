from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from kernel.bundle import Pool
from kernel.etcd_store import EtcdStore
from leasehold.local.procs import EtcdCluster
from tests.support.allocator_app import unique_prefix
from tests.support.policies import write_pools

W = 60_000


class TestClock:
    """The allocator leader's clock for a test: real time plus an adjustable offset, or frozen."""

    __test__ = False

    def __init__(self) -> None:
        self.offset = 0
        self.frozen: int | None = None

    def __call__(self) -> int:
        return self.frozen if self.frozen is not None else time.time_ns() // 1_000_000 + self.offset

    def place_in_window(self, window_ms: int, at_ms: int, freeze: bool = False) -> int:
        """Move the clock so that it reads ``at_ms`` into the *next* window; returns that time."""
        real = time.time_ns() // 1_000_000
        target = (real // window_ms + 1) * window_ms + at_ms
        self.offset = target - real
        if freeze:
            self.frozen = target
        return target


@pytest.fixture
def clock() -> TestClock:
    return TestClock()


@pytest.fixture
def prefix() -> str:
    return unique_prefix()


@pytest.fixture
def make_bundle(tmp_path: Path) -> Callable[..., Path]:
    def make(*pools: Pool, name: str = "bundle.json") -> Path:
        return write_pools(tmp_path / name, list(pools))
    return make


@pytest.fixture
async def etcd_reader(etcd_cluster: EtcdCluster) -> AsyncIterator[EtcdStore]:
    """An independent etcd client for reading the allocator's own keys in assertions."""
    store = EtcdStore(",".join(etcd_cluster.endpoints), timeout_s=5)
    yield store
    await store.close()
