"""The fixtures start real servers: a real Redis answers PING, the cluster is a real
3-master cluster, etcd is a real 3-member cluster."""

import subprocess

import pytest

pytestmark = pytest.mark.integration


def test_redis_is_real(redis_server):
    assert redis_server.cli("PING") == "PONG"
    assert "redis_version:7" in redis_server.cli("INFO", "server")


def test_redis_cluster_has_three_masters(redis_cluster):
    info = redis_cluster.nodes[0].cli("CLUSTER", "INFO")
    assert "cluster_state:ok" in info
    assert "cluster_size:3" in info


def test_etcd_cluster_has_three_members(etcd_cluster):
    out = subprocess.run(["etcdctl", "--endpoints", ",".join(etcd_cluster.endpoints), "member", "list"],
                         capture_output=True, text=True, check=True, env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"})
    assert len(out.stdout.strip().splitlines()) == 3
