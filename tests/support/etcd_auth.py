"""A real etcd with authentication on and the roles of ``deploy/etcd/leasehold-roles.sh`` (one
random password per user of :data:`leasehold.local.procs.ETCD_USERS`), for the tests of etcd
refusing the allocator or an agent."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from leasehold.local.procs import ETCD_USERS, EtcdCluster

PREFIX = "/leasehold/"  # the roles script's default prefix


@dataclass
class AuthEtcd:
    cluster: EtcdCluster
    passwords: dict[str, str]
    files: dict[str, Path]

    def root(self, *args: str) -> str:
        return self.cluster.etcdctl(*args, user=f"root:{self.passwords['root']}")


def auth_etcd_cluster(tmp_path: Path) -> Iterator[AuthEtcd]:
    """A test module's fixture: ``auth_etcd = pytest.fixture(auth_etcd_cluster)``."""
    cluster = EtcdCluster(tmp_path / "etcd", members=1).start()
    pw = {u: secrets.token_urlsafe(12) for u in ETCD_USERS}
    files = {}
    for user, password in pw.items():
        files[user] = tmp_path / f"{user}.password"
        files[user].write_text(password)
    try:
        cluster.apply_roles(files, PREFIX)
        yield AuthEtcd(cluster, pw, files)
    finally:
        cluster.stop()
