"""kernel.etcd_endpoints and kernel.etcd_tls.link_credentials: which etcd links use TLS."""

from pathlib import Path

import pytest

from kernel.etcd_endpoints import endpoints_scheme, parse_endpoints
from kernel.etcd_store import EtcdStore
from kernel.etcd_tls import link_credentials


def test_parse_keeps_host_and_port_and_the_scheme_is_not_lost():
    assert parse_endpoints("http://a:1, b:2") == [("a", 1), ("b", 2)]
    assert parse_endpoints(["https://a:1", "https://b:2/"]) == [("a", 1), ("b", 2)]
    assert endpoints_scheme("https://a:1,b:2") == "https"
    assert endpoints_scheme("a:1") is None and endpoints_scheme("http://a:1") == "http"
    for bad in (" , ", "nohost", "a:b", "a:0", "a:70000", "ftp://a:1", "unix:///x"):
        with pytest.raises(ValueError):
            parse_endpoints(bad)
    with pytest.raises(ValueError, match="mix http:// and https://"):
        parse_endpoints("http://a:1,https://b:2")


def test_link_credentials_rules(tmp_path: Path):
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")  # not parsed here: grpc reads it at connect
    assert link_credentials("a:1") is None
    assert link_credentials("http://a:1") is None
    assert link_credentials("https://a:1") is not None  # grpc's public roots, never plaintext
    assert link_credentials("a:1", str(ca)) is not None  # a CA file implies TLS
    with pytest.raises(ValueError, match="http:// but TLS files"):
        link_credentials("http://a:1", str(ca))
    with pytest.raises(ValueError, match="go together"):
        link_credentials("a:1", cert_file=str(ca))


def test_the_store_never_dials_https_in_plaintext():
    assert EtcdStore("https://a:1")._tls is not None
    assert EtcdStore("a:1")._tls is None
    with pytest.raises(ValueError, match="http://"):
        EtcdStore("http://a:1", tls=link_credentials("https://a:1"))
