"""Request bodies for the load generators: a realistic Northstar mix over many principals,
batches of it, lease requests for the allocator and a single hot key. Each workload is a
function ``body(i) -> bytes`` for the i-th request a generator sends (cheap: string formatting)."""

from __future__ import annotations

import json
from collections.abc import Callable

Body = Callable[[int], bytes]

# (share out of 20, tenant, principal type, route group)
MIX = ((12, "atlas", "user", "read"), (4, "birch", "user", "read"), (2, "atlas", "user", "write"),
       (2, None, "anonymous", "login"))
_SLOTS = [m for m in MIX for _ in range(m[0])]


def admit_item(i: int, principals: int = 10_000, tag: str = "b") -> dict:
    """The i-th request of the Northstar mix (users of Atlas and Birch reading and writing,
    anonymous logins from many addresses), spread over ``principals`` principals."""
    _, tenant, ptype, route = _SLOTS[(i * 7) % len(_SLOTS)]
    p = (i * 7919) % principals
    pid = f"10.{(p >> 16) & 255}.{(p >> 8) & 255}.{p & 255}" if ptype == "anonymous" else f"user-{p}"
    body: dict = {"requestId": f"{tag}-{i:010d}", "principal": {"type": ptype, "id": pid}, "routeGroup": route}
    if tenant:
        body["tenantId"] = tenant
    return body


def admit(principals: int = 10_000, tag: str = "b") -> Body:
    return lambda i: json.dumps(admit_item(i, principals, tag), separators=(",", ":")).encode()


def admit_batch(size: int = 100, principals: int = 10_000, tag: str = "b") -> Body:
    def body(i: int) -> bytes:
        items = [admit_item(i * size + j, principals, tag) for j in range(size)]
        return json.dumps({"requests": items}, separators=(",", ":")).encode()
    return body


def hot_key(tenant: str = "atlas", user: str = "hot-user", route: str = "read", tag: str = "h") -> Body:
    return lambda i: (f'{{"requestId":"{tag}-{i:010d}","tenantId":"{tenant}","routeGroup":"{route}",'
                      f'"principal":{{"type":"user","id":"{user}"}}}}').encode()


def tenant_admit(tenants: int, tag: str = "u") -> Body:
    """One request per call for a tenant-scoped pool rule (tenant ``t0`` .. ``t{n-1}``), route write."""
    return lambda i: (f'{{"requestId":"{tag}-{i:010d}","tenantId":"t{i % tenants}","routeGroup":"write",'
                      f'"principal":{{"type":"service","id":"svc-{i % 97}"}}}}').encode()


def global_admit(tenants: int = 10, route: str = "search", tag: str = "g") -> Body:
    """One request per call for a global-scope pool rule (route ``search``), from tenants ``g0`` ..:
    the fleet-wide pool is spent from every tenant's requests through in-process chunks."""
    return lambda i: (f'{{"requestId":"{tag}-{i:010d}","tenantId":"g{i % tenants}","routeGroup":"{route}",'
                      f'"principal":{{"type":"service","id":"svc-{i % 97}"}}}}').encode()


def lease_batch(pools: int, size: int = 64, region: str = "bench", tag: str = "L", want: int = 1) -> Body:
    """Lease requests over distinct pools ``p00000`` .., each with a fresh leaseId."""
    def body(i: int) -> bytes:
        reqs = [{"leaseId": f"{tag}-{i:08d}-{j:04d}", "region": region, "pool": pool_id((i * size + j) % pools),
                 "want": want} for j in range(size)]
        return json.dumps({"requests": reqs}, separators=(",", ":")).encode()
    return body


def lease_batch_of(pool_ids: list[str], size: int = 64, region: str = "bench", tag: str = "L",
                   want: int = 1) -> Body:
    """Like :func:`lease_batch`, over the given pools only (e.g. those one shard leader leads)."""
    n = len(pool_ids)

    def body(i: int) -> bytes:
        reqs = [{"leaseId": f"{tag}-{i:08d}-{j:04d}", "region": region, "pool": pool_ids[(i * size + j) % n],
                 "want": want} for j in range(size)]
        return json.dumps({"requests": reqs}, separators=(",", ":")).encode()
    return body


def pool_id(n: int) -> str:
    return f"p{n:05d}"


WORKLOADS: dict[str, Callable[..., Body]] = {
    "admit": admit, "admit_batch": admit_batch, "hot_key": hot_key, "tenant_admit": tenant_admit,
    "global_admit": global_admit, "lease_batch": lease_batch, "lease_batch_of": lease_batch_of,
}


def lease_single(pools: int, region: str = "bench", tag: str = "S", want: int = 1) -> Body:
    return lambda i: (f'{{"leaseId":"{tag}-{i:010d}","region":"{region}","pool":"{pool_id((i * 7919) % pools)}",'
                      f'"want":{want}}}').encode()


WORKLOADS["lease_single"] = lease_single
