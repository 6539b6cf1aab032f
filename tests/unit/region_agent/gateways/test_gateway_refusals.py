"""A call refused for its token, at the forward-auth door (the raw ASGI handler driven as uvicorn
drives it) and in the RLS door's log line: a 401 for the gateway's token and one for a client's
own bearer token (``--authz-jwks``) are counted apart
(``leasehold_agent_authz_unauthenticated_total{caller}``: only the gateway's pages,
deploy/prometheus/alerts.yml), and a caller without the gateway token is named in the agent's log
by its address, one WARNING per address a minute."""

from __future__ import annotations

import hashlib
import logging

import pytest
from prometheus_client import CollectorRegistry

from kernel.auth import TokenTable
from region_agent.gateways import authz as authz_door
from region_agent.gateways import rls as rls_door
from region_agent.gateways.bearer import BearerVerifier
from region_agent.gateways.metrics import GatewayMetrics
from region_agent.gateways.refused_callers import RefusedCallers
from tests.support.authz_door import ISSUER, FakeGateways, ask, token

GATEWAY_TOKEN = "gw-token-0123456789abcdef"
GATEWAY = (b"authorization", f"Bearer {GATEWAY_TOKEN}".encode())
UNAUTHENTICATED = "leasehold_agent_authz_unauthenticated_total"
CLIENT = "198.51.100.4"  # the connection's peer of every call that names none


class TokenGateways(FakeGateways):
    """:class:`FakeGateways` that authenticate the gateway by its token, with a registry to read."""

    def __init__(self, bearer: BearerVerifier | None = None):
        super().__init__(bearer)
        self.registry = CollectorRegistry()
        self.metrics = GatewayMetrics(self.registry)
        self.tokens = TokenTable([("edge", hashlib.sha256(GATEWAY_TOKEN.encode()).hexdigest())])

    def gateway_tokens(self) -> TokenTable:  # type: ignore[override]  # FakeGateways authenticates no gateway
        return self.tokens

    def refused(self, caller: str) -> float | None:
        return self.registry.get_sample_value(UNAUTHENTICATED, {"caller": caller})


@pytest.fixture(autouse=True)
def fresh_logs(monkeypatch):
    """The doors' per-address log lines start afresh in every test (one line per address a minute)."""
    monkeypatch.setattr(authz_door, "refused_callers", RefusedCallers(authz_door.log))
    monkeypatch.setattr(rls_door, "refused_callers", RefusedCallers(rls_door.log))


def refusals(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "no valid gateway token" in r.getMessage()]


def test_a_call_without_the_gateway_token_is_counted_as_the_gateways_and_names_its_caller(caplog):
    gw = TokenGateways()
    assert gw.refused("gateway") == 0 and gw.refused("client") == 0  # exported from the start
    with caplog.at_level(logging.WARNING, logger=authz_door.log.name):
        for headers in ([], [(b"authorization", b"Bearer wrong-token-xxxxxxxx")]):
            assert ask(gw, [(b"x-tenant-id", b"atlas"), (b"x-user-id", b"U-1"), *headers], client=CLIENT)[0] == 401
        assert ask(gw, [(b"x-tenant-id", b"atlas"), (b"x-user-id", b"U-1")], client="203.0.113.50")[0] == 401
    assert gw.refused("gateway") == 3 and gw.refused("client") == 0 and gw.asked == []
    # one line per caller's address a minute, each naming it
    assert refusals(caplog) == ["forward-auth call refused: no valid gateway token, from 198.51.100.4",
                                "forward-auth call refused: no valid gateway token, from 203.0.113.50"]
    assert all(r.levelno == logging.WARNING for r in caplog.records if "no valid gateway token" in r.getMessage())
    # the gateway's own calls are not refusals
    assert ask(gw, [GATEWAY, (b"x-tenant-id", b"atlas"), (b"x-user-id", b"U-1")], client=CLIENT)[0] == 200
    assert gw.refused("gateway") == 3


def test_a_clients_own_token_refused_is_the_clients_not_the_gateways(tmp_path, caplog):
    """With --authz-jwks a request without a valid client token is a 401 too: the door working
    (the address window spends it), counted apart, no log line."""
    verifier = BearerVerifier(str(ISSUER.write_jwks(tmp_path / "jwks.json")), issuer=ISSUER.issuer,
                              audience=ISSUER.audience)
    gw = TokenGateways(verifier)
    with caplog.at_level(logging.WARNING, logger=authz_door.log.name):
        # the gateway's token in X-Leasehold-Authorization, the client's own in Authorization (Traefik)
        gateway = (b"x-leasehold-authorization", GATEWAY[1])
        assert ask(gw, [gateway], client=CLIENT)[0] == 401
        assert ask(gw, [gateway, (b"authorization", b"Bearer not.a.jwt")], client=CLIENT)[0] == 401
        assert ask(gw, [gateway, token("U-17")], client=CLIENT)[0] == 200
    assert gw.refused("client") == 2 and gw.refused("gateway") == 0
    assert refusals(caplog) == []


@pytest.mark.parametrize(("peer", "address"), [
    ("ipv4:10.1.2.3:50412", "10.1.2.3"), ("ipv6:[fd00::1]:50412", "fd00::1"),
    ("unix:/run/agent.sock", "/run/agent.sock"), ("", "unknown"), (None, "unknown")])
def test_the_rls_door_names_the_callers_address_without_its_port(peer, address, caplog):
    with caplog.at_level(logging.WARNING, logger=rls_door.log.name):
        rls_door.log_refused(peer)
        rls_door.log_refused(peer)  # the same address within the minute: no second line
    assert refusals(caplog) == [f"RLS call refused: no valid gateway token, from {address}"]


def test_each_door_names_a_refused_caller_in_its_own_log(caplog):
    """One address refused at forward auth and at the RLS door, twice each within the minute: one
    line at each door, in each door's logger (the alerts' runbooks read them there); a refusal at
    one door does not silence the other."""
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            assert ask(TokenGateways(), [(b"x-user-id", b"U-1")], client="192.0.2.9")[0] == 401
            rls_door.log_refused("ipv4:192.0.2.9:50412")
    lines = [(r.name, r.levelno, r.getMessage()) for r in caplog.records if "no valid gateway token" in r.getMessage()]
    assert lines == [
        (authz_door.log.name, logging.WARNING, "forward-auth call refused: no valid gateway token, from 192.0.2.9"),
        (rls_door.log.name, logging.WARNING, "RLS call refused: no valid gateway token, from 192.0.2.9")]
