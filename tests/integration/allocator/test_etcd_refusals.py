"""etcd refusing the allocator, as an operator meets it: authentication on with the roles of
``deploy/etcd/leasehold-roles.sh`` (a wrong password, a permission revoked at runtime, the user
deleted), TLS with a CA that did not sign etcd's certificate, and a database over its
``--quota-backend-bytes`` (the NOSPACE alarm). Each against a real etcd and the allocator as a
process (``python -m allocator``):

* a start with credentials, a permission or TLS etcd refuses is refused with one line naming
  what to fix (and no password), exit 2 — it used to start, answer ready and log
  ``etcd lease_grant failed: INVALID_ARGUMENT``; a refused handshake also had grpc's core write a
  line of its own before it;
* at runtime a refusal is one error line when it starts and one when it ends, ``/v1/health/store``
  answers 503 naming it, ``leasehold_allocator_etcd_refused{cause}`` is 1 (the alert
  LeaseholdAllocatorEtcdRefused), and grants answer a retriable 503 ``store-refused`` with the
  cause — a revoked permission and NOSPACE used to leave health 200 and the log silent while
  every grant failed;
* it all recovers when the operator fixes it (the roles script re-run, ``etcdctl alarm disarm``).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from allocator.election import ERROR_LOG_EVERY_S as ELECTION_LOG_EVERY_S
from kernel.bundle import Pool
from leasehold.local.procs import (
    LOOPBACK,
    EtcdCluster,
    Proc,
    TlsFiles,
    free_port,
    make_tls,
    wait_port,
)
from leasehold.local.services import allocator_command
from tests.support.etcd_auth import PREFIX, AuthEtcd, auth_etcd_cluster
from tests.support.policies import write_pools
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[3]


auth_etcd = pytest.fixture(auth_etcd_cluster)


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    return write_pools(tmp_path / "pools.json", [Pool(id="p1", window_ms=60_000, limit=100_000, chunk_max=10)])


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_")}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def run_allocator(endpoints: str, bundle: Path, work: Path, password: str | None = None,
                  **flags: object) -> subprocess.CompletedProcess[str]:
    """``python -m allocator`` expected to refuse its start (bounded: a start would serve)."""
    port = free_port()
    cmd = allocator_command(etcd=endpoints, policy=bundle, node_id="a1", host=LOOPBACK, port=port,
                            auth_disabled=True, prefix=PREFIX, **flags)
    env = _env(**({"LEASEHOLD_ALLOCATOR_ETCD_PASSWORD": password} if password is not None else {}))
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, cwd=work)


class Allocator:
    def __init__(self, endpoints: str, bundle: Path, work: Path, password: str | None = None, **flags: object):
        flags.setdefault("prefix", PREFIX)
        self.port = free_port()
        env = _env(**({"LEASEHOLD_ALLOCATOR_ETCD_PASSWORD": password} if password is not None else {}))
        self.proc = Proc(f"alloc-{self.port}", allocator_command(
            etcd=endpoints, policy=bundle, node_id="a1", host=LOOPBACK, port=self.port, auth_disabled=True,
            policy_from_etcd=False, **flags), work, env=env).start()
        self.http = httpx.Client(base_url=f"http://{LOOPBACK}:{self.port}", timeout=10)
        wait_port(self.port, proc=self.proc.popen, timeout=30)
        self._n = 0

    def grant(self) -> httpx.Response:
        self._n += 1
        return self.http.post("/v1/leases", json={"leaseId": f"eu-refusal-{self._n:06d}", "region": "eu",
                                                   "pool": "p1", "want": 1})

    def refused_gauge(self) -> dict[str, float]:
        out = {}
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith("leasehold_allocator_etcd_refused{"):
                cause = line.split('cause="')[1].split('"')[0]
                out[cause] = float(line.rsplit(" ", 1)[1])
        return out

    def log(self) -> str:
        assert self.proc.log_path is not None
        return self.proc.log_path.read_text(errors="replace")

    def stop(self) -> None:
        self.http.close()
        self.proc.stop()


def _leading(a: Allocator) -> bool:
    return a.http.get("/v1/health/store").status_code == 200 and a.http.get("/v1/leader").json()["isSelf"]


def test_refused_credentials_and_permissions_stop_the_start(auth_etcd: AuthEtcd, bundle: Path, tmp_path: Path):
    ep = ",".join(auth_etcd.cluster.endpoints)
    wrong = secrets.token_urlsafe(12)
    r = run_allocator(ep, bundle, tmp_path, password=wrong, etcd_user="allocator")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("allocator: refusing to start: etcd refused the allocator's "
                                                   "credentials"), r.stderr
    assert wrong not in r.stderr and "Traceback" not in r.stderr
    # no user at all against an etcd with authentication on
    r = run_allocator(ep, bundle, tmp_path)
    assert r.returncode == 2 and "--etcd-user is not set" in r.stderr, r.stderr
    # a user that does not exist reads the same
    r = run_allocator(ep, bundle, tmp_path, password=wrong, etcd_user="nobody")
    assert r.returncode == 2 and "credentials" in r.stderr and wrong not in r.stderr, r.stderr
    # the role without one permission it needs (its write to grants/)
    auth_etcd.root("role", "revoke-permission", "leasehold-allocator", f"{PREFIX}grants/", "--prefix=true")
    r = run_allocator(ep, bundle, tmp_path, password=auth_etcd.passwords["allocator"], etcd_user="allocator")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "denied a permission" in r.stderr, r.stderr
    assert auth_etcd.passwords["allocator"] not in r.stderr


def _openssl(d: Path, *args: str, faketime: str | None = None) -> None:
    cmd = ["openssl", *args] if faketime is None else ["faketime", "-f", faketime, "openssl", *args]
    subprocess.run(cmd, cwd=d, check=True, capture_output=True, timeout=60)


def _sign(tls: TlsFiles, name: str, ext: str, days: str = "2", faketime: str | None = None) -> tuple[Path, Path]:
    """A certificate and key signed by ``tls``'s CA, with the extensions ``ext``."""
    d = tls.ca.parent
    _openssl(d, "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
             "-out", f"{name}.csr")
    (d / f"{name}.ext").write_text(ext)
    _openssl(d, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", days, "-extfile", f"{name}.ext", "-out", f"{name}.crt", faketime=faketime)
    return d / f"{name}.crt", d / f"{name}.key"


def test_a_failing_tls_handshake_stops_the_start(tmp_path: Path, bundle: Path):
    """A CA that did not sign etcd's certificate, a certificate of etcd that does not name the host
    dialled, and client certificates etcd refuses (another CA's, expired)."""
    tls, rogue = make_tls(tmp_path / "pki"), make_tls(tmp_path / "rogue")
    assert rogue.client_cert is not None and rogue.client_key is not None
    assert tls.client_cert is not None and tls.client_key is not None
    other_name = _sign(tls, "etcd-other-name", "subjectAltName=DNS:etcd.invalid\nbasicConstraints=CA:FALSE\n")
    expired = _sign(tls, "expired-client", "extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\n", days="1",
                    faketime="-10d")
    misnamed = EtcdCluster(tmp_path / "etcd-misnamed", members=1, client_cert_auth=True,
                           tls=TlsFiles(ca=tls.ca, cert=other_name[0], key=other_name[1]))
    misnamed.wait_healthy = lambda timeout=30.0: None  # type: ignore[method-assign]  # etcdctl would refuse the name too
    clusters = [EtcdCluster(tmp_path / "etcd-tls", members=1, tls=tls, client_cert_auth=True).start(), misnamed.start()]
    try:
        good, misnamed = clusters
        cases = {"another CA": (good, rogue.ca, tls.client_cert, tls.client_key),
                 "host name not in etcd's certificate": (misnamed, tls.ca, tls.client_cert, tls.client_key),
                 "a client certificate of another CA": (good, tls.ca, rogue.client_cert, rogue.client_key),
                 "an expired client certificate": (good, tls.ca, *expired)}
        for why, (cluster, ca, cert, key) in cases.items():
            r = run_allocator(",".join(cluster.urls), bundle, tmp_path, etcd_ca_file=ca, etcd_cert_file=cert,
                              etcd_key_file=key, etcd_timeout_ms=1500)
            assert r.returncode == 2, f"{why}: {r.stderr}"
            # one line: grpc's core also wrote its own line of the handshake's failure before it
            lines = r.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("allocator: refusing to start: the TLS handshake with "
                                                           "etcd failed"), f"{why}: {r.stderr}"
        # the right files start it
        a = Allocator(",".join(good.urls), bundle, tmp_path / "ok", etcd_ca_file=tls.ca,
                      etcd_cert_file=tls.client_cert, etcd_key_file=tls.client_key)
        try:
            assert wait_until(lambda: _leading(a), 30)
        finally:
            a.stop()
    finally:
        for c in clusters:
            c.stop()


def test_a_permission_revoked_at_runtime_is_one_line_a_503_and_a_gauge_until_granted_again(
        auth_etcd: AuthEtcd, bundle: Path, tmp_path: Path):
    a = Allocator(",".join(auth_etcd.cluster.endpoints), bundle, tmp_path / "a1",
                  password=auth_etcd.passwords["allocator"], etcd_user="allocator")
    try:
        assert wait_until(lambda: _leading(a), 30)
        assert a.grant().status_code == 200
        assert a.refused_gauge() == {"auth": 0.0, "permission": 0.0, "nospace": 0.0, "tls": 0.0}
        auth_etcd.root("role", "revoke-permission", "leasehold-allocator", f"{PREFIX}grants/", "--prefix=true")
        answers = [a.grant() for _ in range(5)]
        assert {r.status_code for r in answers} == {503}
        assert {r.json()["type"].rsplit("/", 1)[1] for r in answers} == {"store-refused"}, answers[0].text
        assert {r.json()["cause"] for r in answers} == {"permission"} and all(r.json()["retriable"] for r in answers)
        health = a.http.get("/v1/health/store")
        assert health.status_code == 503 and health.json()["etcd"] == "refusing", health.text
        assert health.json()["refused"] == {"grants": "permission"}
        assert a.refused_gauge()["permission"] == 1.0
        assert a.log().count("etcd refuses this client's grants calls (permission") == 1, a.log()
        # the operator re-runs the roles script: the grants go through again, and it is said once
        auth_etcd.cluster.apply_roles(auth_etcd.files, PREFIX)
        assert wait_until(lambda: a.grant().status_code == 200, 20)
        assert a.http.get("/v1/health/store").status_code == 200
        assert a.refused_gauge()["permission"] == 0.0
        assert a.log().count("etcd accepts this client's grants calls again") == 1
    finally:
        a.stop()


def test_a_user_deleted_at_runtime_is_refused_then_followed_when_recreated(
        auth_etcd: AuthEtcd, bundle: Path, tmp_path: Path):
    a = Allocator(",".join(auth_etcd.cluster.endpoints), bundle, tmp_path / "a1",
                  password=auth_etcd.passwords["allocator"], etcd_user="allocator")
    try:
        assert wait_until(lambda: _leading(a), 30)
        auth_etcd.root("user", "delete", "allocator")
        r = a.grant()
        assert r.status_code == 503, r.text
        assert wait_until(lambda: a.refused_gauge()["auth"] == 1.0, 10)
        health = a.http.get("/v1/health/store").json()
        assert health["etcd"] == "refusing" and "auth" in health["refused"].values(), health
        # refused for longer than the election's 10 s between failure lines: the refusal is said once
        time.sleep(ELECTION_LOG_EVERY_S + 0.5)
        assert a.grant().status_code == 503
        assert a.log().count("etcd refuses this client's") in (1, 2, 3), a.log()  # once per kind refused
        assert "election round failed" not in a.log(), a.log()
        auth_etcd.cluster.apply_roles(auth_etcd.files, PREFIX)  # the user again, same password
        assert wait_until(lambda: _leading(a) and a.grant().status_code == 200, 30)
        assert a.refused_gauge()["auth"] == 0.0
        assert "etcd refuses this client's" in a.log() and "calls again" in a.log()
    finally:
        a.stop()


def test_an_etcd_user_on_an_etcd_without_authentication_is_called_without_a_token(
        etcd_cluster: EtcdCluster, bundle: Path, tmp_path: Path):
    """As etcd's own client: an etcd whose authentication is not on (yet: the roles script turns it
    on last) answers Authenticate with "authentication is not enabled"; every call used to fail on
    it, now they go without a token."""
    a = Allocator(",".join(etcd_cluster.endpoints), bundle, tmp_path / "a1", password="unused",
                  etcd_user="allocator", prefix="/lh-noauth-user/")
    try:
        assert wait_until(lambda: _leading(a), 30)
        assert a.grant().status_code == 200
    finally:
        a.stop()


def _fill(cluster: EtcdCluster) -> None:
    value = "x" * 100_000
    for i in range(400):
        try:
            cluster.etcdctl("put", f"/junk/{i % 8}", stdin=value)
        except RuntimeError:  # refused: the alarm is raised (the caller checks `alarm list`)
            return
    raise AssertionError("etcd never raised its NOSPACE alarm")


def test_nospace_is_said_and_recovers_after_compact_defrag_disarm(tmp_path: Path, bundle: Path):
    cluster = EtcdCluster(tmp_path / "etcd", members=1,
                          extra_args=["--quota-backend-bytes", str(4 * 1024 * 1024)]).start()
    a = Allocator(",".join(cluster.endpoints), bundle, tmp_path / "a1", etcd_compaction_interval_s=0)
    try:
        assert wait_until(lambda: _leading(a), 30)
        assert a.grant().status_code == 200
        _fill(cluster)
        assert "NOSPACE" in cluster.etcdctl("alarm", "list")
        answers = [a.grant() for _ in range(5)]
        assert all(r.status_code == 503 and r.json()["cause"] == "nospace" for r in answers), answers[0].text
        health = a.http.get("/v1/health/store")
        assert health.status_code == 503 and "nospace" in health.json()["refused"].values(), health.text
        assert a.refused_gauge()["nospace"] == 1.0
        said = a.log().count("(nospace: first refused")
        assert said in (1, 2), a.log()  # once per kind of call refused (the records' etcd lease, the grants)
        assert a.grant().status_code == 503 and a.log().count("(nospace: first refused") == said
        # the runbook's steps: compact, defragment, disarm
        status = json.loads(cluster.etcdctl("endpoint", "status", "-w", "json"))
        cluster.etcdctl("compact", str(status[0]["Status"]["header"]["revision"]))
        cluster.etcdctl("defrag")
        cluster.etcdctl("alarm", "disarm")
        assert wait_until(lambda: a.grant().status_code == 200, 20)
        assert a.http.get("/v1/health/store").status_code == 200
        assert a.refused_gauge()["nospace"] == 0.0
        time.sleep(0.5)
        assert a.log().count("(nospace: first refused") == said and "calls again" in a.log()
    finally:
        a.stop()
        cluster.stop()
