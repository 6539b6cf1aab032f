"""Kernel-level faults: iptables DROP between two network namespaces, cgroup-scoped isolation
of a real etcd member, and services started under faketime."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chaos.nemesis import EtcdMemberIsolate, faketime_env, faketime_prefix
from chaos.netns import NetnsPair, leftover_rules, owned_namespaces
from leasehold.local.procs import EtcdCluster, Proc

pytestmark = pytest.mark.integration

SERVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(16); s.settimeout(0.5)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    try:
        c, _ = s.accept(); c.sendall(b"hi"); c.close()
    except OSError:
        pass
"""
CLIENT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.0) as c:
        c.settimeout(1.0); print(c.recv(2).decode())
except OSError as e:
    print("fail", type(e).__name__)
"""


def connect_from(pair: NetnsPair, port: int) -> str:
    r = subprocess.run([*pair.exec_prefix(pair.a), sys.executable, "-c", CLIENT, pair.b_ip, str(port)],
                       capture_output=True, text=True, timeout=20)
    return r.stdout.strip()


def test_iptables_drop_between_namespaces_blocks_tcp_and_removing_it_heals(tmp_path: Path):
    port = 18080
    with NetnsPair() as pair:
        assert set(owned_namespaces()) >= {pair.a, pair.b}
        server = Proc("ns-server", [*pair.exec_prefix(pair.b), sys.executable, "-c", SERVER, pair.b_ip, str(port)],
                      tmp_path).start()
        try:
            for _ in range(50):  # bounded wait for the server inside the namespace
                if connect_from(pair, port) == "hi":
                    break
                time.sleep(0.1)
            assert connect_from(pair, port) == "hi"
            pair.cut("a->b")
            assert connect_from(pair, port) == "fail TimeoutError"  # SYNs dropped: no answer, no refusal
            pair.heal()
            assert connect_from(pair, port) == "hi"
            pair.cut("b->a")  # one way: the SYN arrives, the SYN-ACK is dropped
            assert connect_from(pair, port).startswith("fail")
            pair.heal()
            assert connect_from(pair, port) == "hi"
        finally:
            server.stop()
    assert pair.a not in owned_namespaces() and pair.b not in owned_namespaces()


def test_namespaces_are_deleted_when_the_body_fails():
    with pytest.raises(RuntimeError), NetnsPair() as pair:
        pair.cut("both")
        raise RuntimeError("boom")
    assert not {pair.a, pair.b} & set(owned_namespaces())
    assert not [r for r in leftover_rules() if pair.tag in r]


def etcdctl(cluster: EtcdCluster, i: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["etcdctl", "--endpoints", cluster.endpoints[i], "--command-timeout=1500ms",
                           "--dial-timeout=1s", *args], capture_output=True, text=True, timeout=20,
                          env={**os.environ, "ETCDCTL_API": "3"})


def put_eventually(cluster: EtcdCluster, i: int, key: str, value: str, attempts: int = 20) -> bool:
    for _ in range(attempts):
        if etcdctl(cluster, i, "put", key, value).returncode == 0:
            return True
        time.sleep(0.2)
    return False


async def test_isolated_etcd_member_cannot_reach_quorum_and_heals(fresh_etcd_cluster: EtcdCluster):
    cluster = fresh_etcd_cluster
    assert put_eventually(cluster, 0, "before", "1")
    victim = 2
    assert put_eventually(cluster, victim, "via-victim", "ok")  # healthy: the member commits
    nemesis = EtcdMemberIsolate(cluster, victim)
    async with nemesis.active_for():
        assert cluster.procs[victim].alive()
        # the isolated member cannot commit anything (the outcome stays indeterminate: TCP may
        # still deliver the proposal after healing, so it goes to a key nothing else checks)
        r = etcdctl(cluster, victim, "put", "during-victim", "x")
        assert r.returncode != 0
        assert put_eventually(cluster, 0, "during", "2")  # the majority carries on (re-electing if needed)
        r = etcdctl(cluster, victim, "get", "during")  # linearizable read needs the leader
        assert r.returncode != 0 or "2" not in r.stdout
    assert not [rule for rule in leftover_rules() if "OUTPUT" in rule]
    for _ in range(30):  # bounded: the member catches up after healing
        r = etcdctl(cluster, victim, "get", "during", "--print-value-only")
        if r.returncode == 0 and r.stdout.strip() == "2":
            break
        await asyncio.sleep(0.2)
    assert r.stdout.strip() == "2"
    assert nemesis.records and nemesis.records[0].target == "etcd:m2"


PROBE = "import json, time; print(json.dumps({'wall': time.time()}))"
DRIFT_PROBE = """
import json, time
def up():
    with open('/proc/uptime') as f:
        return float(f.read().split()[0])
t0, u0 = time.time(), up()
while up() - u0 < 0.6:
    pass
print(json.dumps({'fake': time.time() - t0, 'real': up() - u0}))
"""


def test_python_under_faketime_sees_the_skew():
    r = subprocess.run([*faketime_prefix(skew_s=3), sys.executable, "-c", PROBE], capture_output=True,
                       text=True, timeout=30, check=True)
    skew = json.loads(r.stdout)["wall"] - time.time()
    assert 2.0 < skew < 3.5
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=30,
                       env=faketime_env(skew_s=-60), check=True)
    skew = json.loads(r.stdout)["wall"] - time.time()  # the child's wall clock runs 60 s behind ours
    assert -65 < skew < -55


def test_python_under_faketime_drift_runs_fast():
    r = subprocess.run([*faketime_prefix(rate=2.0), sys.executable, "-c", DRIFT_PROBE], capture_output=True,
                       text=True, timeout=30, check=True)
    seen = json.loads(r.stdout)
    assert seen["fake"] / seen["real"] > 1.5  # the service's clock runs twice as fast as the kernel's
