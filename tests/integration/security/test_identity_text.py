"""One principal is one name on every door. A gateway that authenticated the caller sends the
user id it took from the caller's token as the UTF-8 bytes of its text (nginx, Envoy and Traefik
copy header values as bytes); ``/v1/admit`` and RLS receive the same id as text (JSON, protobuf
strings). The forward-auth door read header values as Latin-1, so an id that is not ASCII named
another principal there, with a bucket of its own: twice the limit for a caller reachable through
two doors. Sent through a real socket to a real agent process, byte for byte."""

from __future__ import annotations

import httpx

from .conftest import TOKEN, Service


def _authz(client: httpx.Client, svc: Service, user: bytes) -> httpx.Response:
    headers = [(b"authorization", f"Bearer {TOKEN}".encode()), (b"x-tenant-id", b"atlas"), (b"x-user-id", user),
               (b"x-api-key-id", b"K1"), (b"x-route-group", b"read")]
    return client.get(svc.base + "/v1/authz/catalog", headers=headers)


def test_a_user_id_that_is_not_ascii_is_one_bucket_on_every_door(agent_service: Service):
    user = "Zoë-Ünal-北"
    admit = {"tenantId": "atlas", "principal": {"type": "user", "id": user, "apiKeyId": "K1"}, "routeGroup": "read"}
    with httpx.Client(timeout=30) as client:
        spent = 0
        for i in range(40):  # read-user-v3: 20 tokens; spend them all through /v1/admit
            d = client.post(agent_service.base + "/v1/admit", json={**admit, "requestId": f"r-zoe-{i:06d}"},
                            headers=agent_service.headers).json()
            if not d["allowed"]:
                break
            spent += 1
        assert 0 < spent < 40, spent
        r = _authz(client, agent_service, user.encode())
        assert r.status_code == 429, (r.status_code, r.headers)  # the same bucket, already empty
        assert r.headers["ratelimit"].startswith('"read-user-v3";r=0;')
        # bytes that are not UTF-8 (the Latin-1 spelling of an id) are refused, never guessed at
        bad = _authz(client, agent_service, "Zoë".encode("latin-1"))
        assert bad.status_code == 422 and bad.headers["content-type"] == "application/problem+json"
        assert "x-user-id is not UTF-8" in bad.json()["detail"]
