"""Without root or CAP_NET_ADMIN the kernel-level partitions refuse with a message that says so,
before any `ip` or `iptables` call fails obscurely."""

from __future__ import annotations

import pytest

from chaos import netns


def test_cap_net_admin_is_read_from_the_effective_set():
    assert netns.has_net_admin("Name:\tx\nCapEff:\t000001fffeffffff\n") is True
    assert netns.has_net_admin("CapEff:\t0000000000001000\n") is True  # bit 12 alone
    assert netns.has_net_admin("CapEff:\t0000000000000000\n") is False
    assert netns.has_net_admin("CapEff:\t00000000a80425fb\n") is False  # a container's default set


def test_partitions_say_what_they_need(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(netns, "has_net_admin", lambda status=None: False)
    calls: list[tuple] = []
    monkeypatch.setattr(netns, "run", lambda *a, **k: calls.append(a))
    with pytest.raises(netns.NetError, match="needs root or CAP_NET_ADMIN.*make test"):
        netns.NetnsPair().create()
    with pytest.raises(netns.NetError, match="needs root or CAP_NET_ADMIN"):
        netns.MemberIsolation(pid=1, own_port=2380, peer_ports=[2381]).apply()
    assert calls == []  # nothing was attempted
