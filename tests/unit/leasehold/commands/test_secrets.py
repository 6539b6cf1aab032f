"""``leasehold secrets generate``'s etcd TLS material (decision 0069): a CA and a certificate for the
members that the services' TLS stack accepts for every name the shipped manifests dial etcd by,
and that nothing else (another CA's certificate, another name) passes; keys 0600."""

from __future__ import annotations

import ssl
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from leasehold.commands.secrets import etcd_hostnames, file_names, generate


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
