"""TLS for etcd connections.

Which links use TLS (:func:`link_credentials`, the one rule for the allocator, the agent and
the CLI, as etcdctl does it): an ``https://`` endpoint, or any of the CA / client certificate
files given. The CA verifies etcd's certificate (without it, grpc's bundled public roots or
``GRPC_DEFAULT_SSL_ROOTS_FILE_PATH``); the client certificate and key, given together, answer
etcd's ``--client-cert-auth``. ``http://`` endpoints with TLS files are refused, never
downgraded; an ``https://`` endpoint is never dialled in plaintext.

The credentials go to the channels :class:`kernel.etcd_store.EtcdStore` opens itself
(``grpc.aio.secure_channel``); nothing of a library is replaced.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from .etcd_endpoints import endpoints_scheme


def credentials(ca_file: str | None, cert_file: str | None = None, key_file: str | None = None
                ) -> grpc.ChannelCredentials | None:
    """Channel credentials from PEM files (CA to verify etcd; optional client cert and key);
    ``None`` when no file is given."""
    if not (ca_file or cert_file or key_file):
        return None
    if bool(cert_file) != bool(key_file):
        raise ValueError("an etcd client certificate and its key go together: give both or neither")

    def read(path: str | None) -> bytes | None:
        if not path:
            return None
        with open(path, "rb") as f:
            return f.read()

    return grpc.ssl_channel_credentials(root_certificates=read(ca_file), private_key=read(key_file),
                                        certificate_chain=read(cert_file))


def link_credentials(endpoints: str | Sequence[str], ca_file: str | None = None, cert_file: str | None = None,
                     key_file: str | None = None) -> grpc.ChannelCredentials | None:
    """The channel credentials of one etcd link, ``None`` for plaintext (the rule in the module
    docstring). ``ValueError`` for ``http://`` endpoints with TLS files, a certificate without
    its key (or the reverse), mixed schemes; ``OSError`` for an unreadable file."""
    scheme = endpoints_scheme(endpoints)
    given = [f for f in (ca_file, cert_file, key_file) if f]
    if scheme == "http" and given:
        raise ValueError("etcd endpoints say http:// but TLS files are given: write https:// endpoints "
                         "(or host:port) for TLS, or drop the TLS files")
    creds = credentials(ca_file, cert_file, key_file)
    if creds is None and scheme == "https":
        creds = grpc.ssl_channel_credentials()  # grpc's public roots: never plaintext to https://
    return creds

