"""Two agents in one process share no decision state: each answers from its own bundle's snapshot
(rules, shapes, the RateLimit field text) with its own retry jitter (docs/hot-path.md: every memo
of the request path hangs on the snapshot its policy holder made, none on a module)."""

from __future__ import annotations

from pathlib import Path

import msgspec
from litestar.testing import AsyncTestClient

from region_agent.service.app import create_app
from tests.support.agent import PEPPER, admit_body, make_settings
from tests.support.policies import northstar, write_bundle

READ_USER = "read-user-v3"


def bundle_file(path: Path, *, tokens: int, version_up: int):
    """The sample bundle ``version_up`` versions later, with read-user-v3 holding ``tokens`` tokens
    and refilling one per 100 s (no refill within the test, however slow the machine)."""
    b = northstar()
    rules = [msgspec.structs.replace(r, capacity_millis=tokens * 1000, refill_millis=10) if r.id == READ_USER else r
             for r in b.rules]
    return write_bundle(path, b, bundle_version=b.bundle_version + version_up, rules=rules)


async def test_two_apps_with_different_bundles_and_jitter_do_not_interfere(redis_url, tmp_path):
    a_file, b_file = tmp_path / "a.json", tmp_path / "b.json"
    a_bundle = bundle_file(a_file, tokens=3, version_up=1)
    b_bundle = bundle_file(b_file, tokens=5, version_up=2)
    app_a = create_app(make_settings(redis_url, a_file), pepper=PEPPER)  # jitter off (make_settings)
    app_b = create_app(make_settings(redis_url, b_file, retry_jitter_max_ms=5_000, retry_jitter_pct=10,
                                     retry_jitter_min_ms=1_000, retry_jitter_seed="b"), pepper=PEPPER)
    async with AsyncTestClient(app=app_a) as a, AsyncTestClient(app=app_b) as b:
        seen: dict[str, list[dict]] = {"a": [], "b": []}
        for i in range(12):  # interleaved: each app's answers while the other one is answering too
            for name, client, user in (("a", a, "U-two-a"), ("b", b, "U-two-b")):
                resp = await client.post("/v1/admit", json=admit_body(f"two-{name}-{i:04d}", pid=user))
                assert resp.status_code == 200, resp.text
                seen[name].append(resp.json())
        a_seen, b_seen = seen["a"], seen["b"]
        # each app decides with its own bundle: its version, its rule's limit, its own header text
        assert {d["policyVersion"] for d in a_seen} == {a_bundle.bundle_version}
        assert {d["policyVersion"] for d in b_seen} == {b_bundle.bundle_version}
        assert a_seen[0]["limit"] == 3 and b_seen[0]["limit"] == 5
        assert a_seen[0]["headers"]["RateLimit-Policy"] == f'"{READ_USER}";q=3;w=300'  # full refill: 300 s
        assert b_seen[0]["headers"]["RateLimit-Policy"] == f'"{READ_USER}";q=5;w=500'
        assert [d["allowed"] for d in a_seen] == [True] * 3 + [False] * 9
        assert [d["allowed"] for d in b_seen] == [True] * 5 + [False] * 7
        # each app's jitter: none on a's denials, b's spread upward from the same kind of hint
        a_denied = [d for d in a_seen if not d["allowed"]]
        b_denied = [d for d in b_seen if not d["allowed"]]
        assert a_denied and b_denied
        assert {d["retryJitterMs"] for d in a_denied} == {0}
        assert all(int(d["headers"]["Retry-After"]) == max(1, -(-d["retryAfterMs"] // 1000)) for d in a_denied)
        assert len({d["retryJitterMs"] for d in b_denied}) > 1 and all(d["retryJitterMs"] >= 0 for d in b_denied)
