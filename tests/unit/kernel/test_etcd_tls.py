"""kernel.etcd_tls is the one adapter over aetcd's private channel creation: these checks fail
when an aetcd release changes what it relies on (``Client.connect`` opening its channel with
``aetcd.rpc.insecure_channel``), before a TLS etcd link silently turns plaintext."""

import inspect

import aetcd
import aetcd.client
import aetcd.rpc
import grpc

from kernel import etcd_tls


def test_aetcd_still_opens_its_channel_through_rpc_insecure_channel():
    source = inspect.getsource(aetcd.client.Client.connect)
    assert "rpc.insecure_channel(" in source
    assert aetcd.client.rpc is aetcd.rpc


def test_the_dispatcher_is_installed_and_plaintext_without_credentials():
    assert aetcd.rpc.insecure_channel is etcd_tls._channel
    assert etcd_tls._plaintext is grpc.aio.insecure_channel


async def test_a_tls_client_gets_a_secure_channel(monkeypatch):
    made: list[str] = []
    monkeypatch.setattr(grpc.aio, "secure_channel", lambda *a, **k: made.append("secure") or object())
    monkeypatch.setattr(etcd_tls, "_plaintext", lambda *a, **k: made.append("plain") or object())
    token = etcd_tls._CREDENTIALS.set(grpc.ssl_channel_credentials())
    try:
        etcd_tls._channel("h:1", None)
    finally:
        etcd_tls._CREDENTIALS.reset(token)
    etcd_tls._channel("h:1", None)
    assert made == ["secure", "plain"]
