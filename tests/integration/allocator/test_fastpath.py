"""The batch routes' fast path (allocator.fastpath) answers exactly what the Litestar handlers
answer: the same requests, valid and hostile, sent to an allocator with and without it (each on
its own prefix of the same etcd, same clock) give the same status, content type and body."""

from __future__ import annotations

import hashlib
import json

from litestar.testing import AsyncTestClient

from allocator import fastpath
from allocator.app import create_app
from kernel.bundle import Pool
from leasehold.local.procs import EtcdCluster
from tests.support.allocator_app import lease_body, settings_for, unique_prefix
from tests.support.waiting import await_until

from .conftest import TestClock, W

TOKENS = {"eu": "eu-token-for-the-fast-path-test", "us": "us-token-for-the-fast-path-test"}
ENTRIES = [f"{r}:{hashlib.sha256(t.encode()).hexdigest()}" for r, t in TOKENS.items()]


def _usage(lease_id: str, pool: str, region: str, spent: int) -> dict:
    return {"leaseId": lease_id, "pool": pool, "region": region, "spent": spent}


# (name, path, extra headers, body): the fast path may serve only those marked True in SERVED
CASES: list[tuple[str, str, dict, bytes | dict]] = [
    ("grants", "/v1/leases/batch", {}, {"requests": [lease_body(f"fp-g-{i:04d}", "fa", "eu", 7) for i in range(5)]}),
    ("grants, errors per item", "/v1/leases/batch", {}, {"requests": [
        lease_body("fp-g-0100", "nope", "eu", 1), lease_body("fp-g-0101", "fb", "eu", 1),
        lease_body("fp-g-0000", "fb", "eu", 3)]}),  # unknown pool, region not allowed, id reused for another pool
    ("grant replays", "/v1/leases/batch", {}, {"requests": [lease_body(f"fp-g-{i:04d}", "fa", "eu", 7) for i in range(3)]}),
    ("another region's item", "/v1/leases/batch", {}, {"requests": [lease_body("fp-g-0200", "fa", "us", 1)]}),
    ("repeated leaseId", "/v1/leases/batch", {}, {"requests": [lease_body("fp-g-0300", "fa", "eu", 1)] * 2}),
    ("empty batch", "/v1/leases/batch", {}, {"requests": []}),
    ("unknown field", "/v1/leases/batch", {}, {"requests": [{**lease_body("fp-g-0400", "fa", "eu", 1), "x": 1}]}),
    ("bad lease id", "/v1/leases/batch", {}, {"requests": [lease_body("x", "fa", "eu", 1)]}),
    ("malformed json", "/v1/leases/batch", {}, b'{"requests": [ '),
    ("not an object", "/v1/leases/batch", {}, b"[1, 2]"),
    ("text content type", "/v1/leases/batch", {"content-type": "text/plain"},
     {"requests": [lease_body("fp-g-0500", "fa", "eu", 1)]}),
    ("repeated key", "/v1/leases/batch", {},
     b'{"requests": [{"leaseId": "fp-g-0800", "leaseId": "fp-g-0801", "region": "eu", "pool": "fa", "want": 1}]}'),
    ("latin-1 charset", "/v1/leases/batch", {"content-type": "application/json; charset=latin-1"},
     {"requests": [lease_body("fp-g-0900", "fa", "eu", 1)]}),
    ("repeated key in a report", "/v1/usage/batch", {},
     b'{"reports": [{"leaseId": "fp-g-0001", "pool": "fa", "region": "eu", "spent": 1, "spent": 0}]}'),
    ("oversized", "/v1/leases/batch", {}, b'{"requests": [{"leaseId": "' + b"a" * 70_000 + b'"}]}'),
    ("no credential", "/v1/leases/batch", {"authorization": ""}, {"requests": [lease_body("fp-g-0600", "fa", "eu", 1)]}),
    ("wrong credential", "/v1/leases/batch", {"authorization": "Bearer nope"},
     {"requests": [lease_body("fp-g-0700", "fa", "eu", 1)]}),
    ("reports", "/v1/usage/batch", {}, {"reports": [_usage(f"fp-g-{i:04d}", "fa", "eu", i) for i in range(4)]
                                        + [_usage("fp-g-none", "fa", "eu", 0), _usage("fp-g-0004", "fa", "eu", 99)]}),
    ("report replays", "/v1/usage/batch", {}, {"reports": [_usage("fp-g-0001", "fa", "eu", 5)]}),
    ("report of another region", "/v1/usage/batch", {}, {"reports": [_usage("fp-g-0001", "fa", "us", 5)]}),
    ("repeated report", "/v1/usage/batch", {}, {"reports": [_usage("fp-g-0002", "fa", "eu", 5)] * 2}),
    ("report of a lease the caller does not hold", "/v1/usage/batch", {"region": "us"},
     {"reports": [_usage("fp-g-0003", "fa", "us", 1)]}),
]
SERVED = ["grants", "grants, errors per item", "grant replays", "reports", "report replays",
          "report of a lease the caller does not hold"]


async def _answers(cluster: EtcdCluster, bundle, clock: TestClock, fast: bool) -> list[tuple[int, str, bytes]]:
    settings = settings_for(cluster, bundle, unique_prefix(), auth_disabled=False, region_tokens=ENTRIES,
                            max_body_bytes=65_536)
    app = create_app(settings, clock=clock, fast_path=fast)
    out = []
    t0 = clock.frozen
    async with AsyncTestClient(app=app, timeout=30) as c:
        assert await await_until(lambda: app.state.election.is_leader), "the allocator did not take the lead"
        for name, path, headers, body in CASES:
            if path == "/v1/usage/batch":
                clock.frozen = t0 + 5_000  # the leases expired
            caller = headers.get("region", "eu")  # whose token the request carries
            h = {"authorization": f"Bearer {TOKENS[caller]}", "content-type": "application/json", **headers}
            h = {k: v for k, v in h.items() if v and k != "region"}
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = await c.post(path, content=content, headers=h)
            out.append((r.status_code, r.headers.get("content-type", ""), r.content))
            assert name  # every case answered
    clock.frozen = t0
    return out


async def test_fast_path_answers_like_the_handlers(etcd_cluster: EtcdCluster, make_bundle, clock: TestClock,
                                                   monkeypatch) -> None:
    bundle = make_bundle(Pool(id="fa", window_ms=W, limit=1_000, lease_ttl_ms=5_000, chunk_max=100),
                         Pool(id="fb", window_ms=W, limit=1_000, chunk_max=100, regions=["us"]))
    clock.place_in_window(W, 1_000, freeze=True)
    served: list[int] = []
    real = fastpath._encode

    def counting(obj):
        served.append(len(obj.results))
        return real(obj)

    monkeypatch.setattr(fastpath, "_encode", counting)
    fast = await _answers(etcd_cluster, bundle, clock, True)
    assert served == [5, 3, 3, 6, 1, 1], served  # the common cases only; the rest went to the handlers
    monkeypatch.setattr(fastpath, "_encode", real)
    slow = await _answers(etcd_cluster, bundle, clock, False)
    for (name, _, _, _), f, s in zip(CASES, fast, slow, strict=True):
        if f[0] == 200:
            f = (f[0], f[1], _without_epoch(f[2]))
            s = (s[0], s[1], _without_epoch(s[2]))
        assert f == s, f"{name}: fast path {f!r} vs handler {s!r}"
    statuses = {name: f[0] for (name, _, _, _), f in zip(CASES, fast, strict=True)}
    assert all(statuses[n] == 200 for n in SERVED), statuses
    # (whether a text/plain body is refused is the handler's business: the fast path never serves it)
    assert all(400 <= statuses[n] < 500 for n in statuses if n not in (*SERVED, "text content type")), statuses


def _without_epoch(raw: bytes) -> bytes:
    """The two allocators lead with different epochs (their own leader keys): compare the rest."""
    body = json.loads(raw)
    for r in body.get("results", []):
        r.pop("epoch", None)
    return json.dumps(body).encode()
