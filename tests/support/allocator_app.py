"""The allocator app in the test's event loop against a real etcd cluster, for the tests of the
allocator and of what talks to it (tests/integration/allocator, security, the error answers): a
bundle file of pools alone (:func:`write_pools`), a fresh etcd key prefix per test, the app's
settings, the app itself (leading), and a lease request's body."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from litestar.testing import AsyncTestClient

from allocator.app import create_app
from allocator.settings import AllocatorSettings
from leasehold.local.procs import EtcdCluster
from tests.support.waiting import await_until


def unique_prefix() -> str:
    return f"/lh-{uuid.uuid4().hex[:12]}/"


def settings_for(cluster: EtcdCluster, bundle: Path, prefix: str, node_id: str = "n1", port: int = 8700,
                 **kw: Any) -> AllocatorSettings:
    kw.setdefault("auth_disabled", True)  # region authentication has its own tests (tests/integration/security)
    return AllocatorSettings(etcd=",".join(cluster.endpoints), policy=str(bundle), node_id=node_id,
                             port=port, prefix=prefix, **kw)


@asynccontextmanager
async def in_process(settings: AllocatorSettings, **kw: Any) -> AsyncIterator[AsyncTestClient]:
    """The allocator app in this event loop, with its real etcd client, leading."""
    app = create_app(settings, **kw)
    async with AsyncTestClient(app=app, timeout=30) as client:
        assert await await_until(lambda: app.state.election.is_leader), \
            "the in-process allocator did not take the lead"
        client.app_state = app.state  # type: ignore[attr-defined]  # the tests read the app state through the client
        yield client


def lease_body(lease_id: str, pool: str, region: str, want: int, demand: int = 0, window: str = "current") -> dict:
    return {"leaseId": lease_id, "region": region, "pool": pool, "want": want, "demand": demand,
            "window": window}
