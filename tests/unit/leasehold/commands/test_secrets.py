"""``leasehold secrets generate``'s etcd TLS material (decision 0069): a CA and a certificate for the
members that the services' TLS stack accepts for every name the shipped manifests dial etcd by,
and that nothing else (another CA's certificate, another name) passes; keys 0600. And a run is all
or nothing: one that fails midway (the real CLI as a process) leaves the directory as it was."""

from __future__ import annotations

import os
import resource
import ssl
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from leasehold.commands.secrets import etcd_hostnames, file_names, generate

ROOT = Path(__file__).resolve().parents[4]


def test_generate_writes_an_etcd_ca_and_a_member_certificate(tmp_path: Path):
    out = tmp_path / "creds"
    generate(out)
    for name in ("etcd-ca.crt", "etcd-ca.key", "etcd-server.crt", "etcd-server.key"):
        assert name in file_names(("eu", "us"))
        mode = stat.S_IMODE((out / name).stat().st_mode)
        assert mode == (0o600 if name.endswith(".key") else 0o644), (name, oct(mode))
    ca = x509.load_pem_x509_certificate((out / "etcd-ca.crt").read_bytes())
    cert = x509.load_pem_x509_certificate((out / "etcd-server.crt").read_bytes())
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = set(sans.get_values_for_type(x509.DNSName))
    # compose's members, the StatefulSet's (short and qualified), a port-forward
    assert {"etcd-0", "etcd-2", "etcd-1.etcd", "etcd-1.etcd.leasehold.svc",
            "etcd-2.etcd.leasehold.svc.cluster.local", "localhost"} <= names == set(etcd_hostnames())
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}  # a member is its peers' client


def test_a_tls_client_trusting_the_ca_accepts_the_member_and_no_other(tmp_path: Path):
    """The handshake as a client does it (name checked against the certificate), in memory."""
    generate(tmp_path / "a")
    generate(tmp_path / "b")

    def handshake(ca: Path, server: Path, host: str) -> None:
        client = ssl.create_default_context(cafile=ca / "etcd-ca.crt")
        srv = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        srv.load_cert_chain(server / "etcd-server.crt", server / "etcd-server.key")
        c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
        c = client.wrap_bio(c_in, c_out, server_hostname=host)
        s = srv.wrap_bio(s_in, s_out, server_side=True)
        for _ in range(10):
            done = 0
            for side, out, peer_in in ((c, c_out, s_in), (s, s_out, c_in)):
                try:
                    side.do_handshake()
                    done += 1
                except ssl.SSLWantReadError:
                    pass
                peer_in.write(out.read())
            if done == 2:
                return
        raise AssertionError("no handshake")

    a, b = tmp_path / "a", tmp_path / "b"
    for host in ("etcd-0.etcd", "etcd-2.etcd.leasehold.svc", "etcd-1", "127.0.0.1", "localhost"):
        handshake(a, a, host)
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(a, b, "etcd-0.etcd")  # another CA's certificate: a stand-in etcd on the path
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(a, a, "etcd-0.example.com")  # a name the certificate does not carry


def _cli(*argv: str, file_size_limit: int | None = None) -> subprocess.CompletedProcess[str]:
    """``leasehold`` as a process; ``file_size_limit``: RLIMIT_FSIZE in bytes, so that a write past
    it fails (EFBIG) as a full disk or a quota would, midway through the run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_")}
    env.update(PYTHONPATH=str(ROOT), PYTHONDONTWRITEBYTECODE="1")

    def limit() -> None:
        if file_size_limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))
    return subprocess.run([sys.executable, "-m", "leasehold.commands.cli", *argv], env=env, capture_output=True,
                          text=True, timeout=120, preexec_fn=limit)


def _snapshot(d: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (stat.S_IMODE(p.stat().st_mode), p.read_bytes() if p.is_file() else b"")
            for p in [d, *d.iterdir()]}


# past every token, password and hash file (the ACL file is the largest, 395 bytes), short of etcd's
# CA certificate (about 580): the run fails after some twenty files are written
MIDWAY = 450


def test_a_run_that_fails_midway_leaves_no_directory(tmp_path: Path):
    """It wrote its files one by one into the directory: a run that failed midway (a full disk, a
    quota) left a directory of some credentials and a truncated certificate that a later deploy
    could pick up, and ended on an unexpected error (exit 70). Now the directory appears whole or
    not at all, and the failure is one line."""
    res = _cli("secrets", "generate", "--out", str(tmp_path / "creds"), file_size_limit=MIDWAY)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [
        f"leasehold: cannot write the credentials to {tmp_path / 'creds'}: File too large; "
        f"{tmp_path / 'creds'} is as it was"], res.stderr
    assert list(tmp_path.iterdir()) == []  # no directory, no staging left behind
    ok = _cli("secrets", "generate", "--out", str(tmp_path / "creds"))
    assert ok.returncode == 0, ok.stderr
    assert sorted(p.name for p in (tmp_path / "creds").iterdir()) == sorted(file_names(("eu", "us")))
    assert stat.S_IMODE((tmp_path / "creds").stat().st_mode) == 0o700 and list(tmp_path.iterdir()) == [tmp_path / "creds"]


def test_a_forced_run_that_fails_midway_leaves_the_credentials_in_place(tmp_path: Path):
    """With --force it replaced the files one by one: a failure midway left new tokens beside old
    hashes (a set no service and gateway agree on). Now every file is the one before, and so are the
    directory's mode and its other files."""
    out = tmp_path / "creds"
    generate(out)
    (out / "README").write_text("ours\n")
    before = _snapshot(out)
    res = _cli("secrets", "generate", "--out", str(out), "--force", file_size_limit=MIDWAY)
    assert res.returncode == 2 and "is as it was" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert _snapshot(out) == before
    # a directory of someone's, open to others and empty: still empty, its mode untouched
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o755)
    empty.chmod(0o755)
    res = _cli("secrets", "generate", "--out", str(empty), file_size_limit=MIDWAY)
    assert res.returncode == 2, res.stderr
    assert _snapshot(empty) == {"empty": (0o755, b"")}
    # and a rerun does what it did: refused without --force, everything replaced with it, the rest kept
    res = _cli("secrets", "generate", "--out", str(out))
    assert res.returncode == 2 and "refusing to replace credentials" in res.stderr, res.stderr
    assert _snapshot(out) == before
    assert _cli("secrets", "generate", "--out", str(out), "--force").returncode == 0
    after = _snapshot(out)
    assert sorted(after) == sorted(before) and after["README"] == before["README"]
    assert all(after[n][1] != before[n][1] for n in file_names(("eu", "us")))
    assert {n: after[n][0] for n in after} == {n: before[n][0] for n in before}


def test_force_does_not_replace_a_directory_in_place_of_a_credential(tmp_path: Path):
    out = tmp_path / "creds"
    generate(out)
    (out / "jwks.json").unlink()
    (out / "jwks.json").mkdir()
    before = _snapshot(out)
    res = _cli("secrets", "generate", "--out", str(out), "--force")
    assert res.returncode == 2 and "jwks.json is a directory, not a credential file" in res.stderr, res.stderr
    assert _snapshot(out) == before
