"""TLS for etcd connections.

aetcd 1.0 always opens plaintext gRPC channels (``rpc.insecure_channel`` inside
``Client.connect``). :class:`TlsClient` keeps aetcd's own connect logic and only swaps the
channel it creates: a dispatcher installed once in place of ``aetcd.rpc.insecure_channel``
opens a ``grpc.aio.secure_channel`` when the connecting task carries TLS credentials (a
context variable set for the duration of that client's ``connect``), and the plaintext
channel otherwise — so clients without TLS are untouched.
"""

from __future__ import annotations

import contextvars
from typing import Any

import aetcd
import aetcd.rpc
import grpc

_CREDENTIALS: contextvars.ContextVar[grpc.ChannelCredentials | None] = contextvars.ContextVar(
    "leasehold_etcd_tls", default=None)
_plaintext = aetcd.rpc.insecure_channel


def _channel(target: str, options: Any = None, *args: Any, **kwargs: Any) -> Any:
    creds = _CREDENTIALS.get()
    if creds is None:
        return _plaintext(target, options, *args, **kwargs)
    return grpc.aio.secure_channel(target, creds, options, *args, **kwargs)


if getattr(aetcd.rpc.insecure_channel, "__name__", "") != "_channel":
    aetcd.rpc.insecure_channel = _channel


def credentials(ca_file: str | None, cert_file: str | None = None, key_file: str | None = None
                ) -> grpc.ChannelCredentials | None:
    """Channel credentials from PEM files (CA to verify etcd; optional client cert and key)."""
    if not ca_file:
        return None

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()

    return grpc.ssl_channel_credentials(root_certificates=read(ca_file), private_key=read(key_file),
                                        certificate_chain=read(cert_file))


class TlsClient(aetcd.Client):
    """aetcd's client, connecting over TLS when given credentials."""

    def __init__(self, *args: Any, tls: grpc.ChannelCredentials | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._tls = tls

    async def connect(self) -> None:
        token = _CREDENTIALS.set(self._tls)
        try:
            await super().connect()
        finally:
            _CREDENTIALS.reset(token)
