"""Authentication and authorisation on real etcd and Redis (docs/invariants.md I3, I14).

Allocator: a bearer token per region (stored as sha256); a region may only request, report
or view its own leases (403, nothing written). Agent: gateway tokens for admission, operator
tokens for /v1/leases and /v1/policy; probes open. Missing, unknown and wrong tokens all get
the same 401 problem. ``leasehold up``'s topology runs with auth on."""

from __future__ import annotations

import contextlib
import hashlib
import io
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import redis
from litestar.testing import AsyncTestClient

from kernel.auth import TokenTable
from kernel.bundle import Pool, encode_bundle, load_bundle_file, seal
from kernel.config import ConfigError
from kernel.etcd_store import EtcdStore
from leasehold.commands.cli import main as cli_main
from leasehold.local.topology import DEFAULT_POLICY, LocalTopology, TopologySpec
from region_agent.service.app import create_app
from tests.support.agent import PEPPER, admit_body, make_settings
from tests.support.allocator_app import in_process, lease_body, settings_for, unique_prefix
from tests.support.policies import write_pools

EU, US = "eu-token-0123456789abcdef", "us-token-fedcba9876543210"
GATEWAY, OPERATOR = "gw-token-aaaaaaaaaaaaaaaa", "op-token-bbbbbbbbbbbbbbbb"


def sha(t: str) -> str:
    return hashlib.sha256(t.encode()).hexdigest()


def bearer(t: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {t}"}


def assert_401(resp: httpx.Response) -> dict:
    assert resp.status_code == 401, resp.text
    assert resp.headers["content-type"].startswith("application/problem+json")
    body = resp.json()
    assert body["type"].endswith("/unauthorized") and body["detail"] == "missing or invalid bearer token"
    return body


def test_token_table_parsing(tmp_path: Path):
    f = tmp_path / "tokens"
    f.write_text(f"# regions\neu:{sha(EU)}\nus sha256:{sha(US)}\n")
    t = TokenTable.parse([], str(f))
    assert (t.who(EU), t.who(US), t.who("nope"), len(t)) == ("eu", "us", None, 2)
    with pytest.raises(ConfigError):
        TokenTable.parse(["eu:not-a-digest"])
    assert TokenTable.parse([sha(GATEWAY)], default_name="gateway").who(GATEWAY) == "gateway"


# -- allocator ----------------------------------------------------------------------------------
async def test_allocator_regions_see_only_their_own_leases(etcd_cluster, tmp_path):
    prefix = unique_prefix()
    bundle = write_pools(tmp_path / "b.json", [Pool(id="p1", window_ms=60_000, limit=100, chunk_max=50)])
    settings = settings_for(etcd_cluster, bundle, prefix, auth_disabled=False,
                            region_tokens=[f"eu:{sha(EU)}", f"us:{sha(US)}"])
    reader = EtcdStore(",".join(etcd_cluster.endpoints))
    try:
        async with in_process(settings) as c:
            body = lease_body("lease-eu-000001", "p1", "eu", 10)
            none = await c.post("/v1/leases", json=body)
            wrong = await c.post("/v1/leases", json=body, headers=bearer("eu-token-guess"))
            assert assert_401(none) == {**assert_401(wrong), "instance": none.json()["instance"]}
            assert (await c.post("/v1/leases", json=body, headers={"Authorization": EU})).status_code == 401
            # a region naming another region: 403, nothing written to etcd
            other = await c.post("/v1/leases", json=body, headers=bearer(US))
            assert other.status_code == 403 and other.json()["type"].endswith("/forbidden")
            batch = {"requests": [lease_body("lease-us-000001", "p1", "us", 5), body]}
            assert (await c.post("/v1/leases/batch", json=batch, headers=bearer(US))).status_code == 403
            assert await reader.get_prefix(f"{prefix}grants/".encode()) == []
            assert await reader.get_prefix(f"{prefix}pools/".encode()) == []
            # its own region: granted
            ok = await c.post("/v1/leases", json=body, headers=bearer(EU))
            assert ok.status_code == 200 and ok.json()["granted"] == 10
            before = await reader.get_prefix(prefix.encode())
            # another region cannot view or report on it (it is not there for that region)
            assert (await c.get("/v1/leases/lease-eu-000001", headers=bearer(US))).status_code == 404
            assert (await c.get("/v1/leases/lease-eu-000001?region=eu", headers=bearer(US))).status_code == 403
            assert (await c.get("/v1/leases/lease-eu-000001", headers=bearer(EU))).status_code == 200
            assert (await c.get("/v1/leases/lease-eu-000001")).status_code == 401
            report = {"leaseId": "lease-eu-000001", "pool": "p1", "region": "us", "spent": 0}
            assert (await c.post("/v1/leases/lease-eu-000001/usage", json=report, headers=bearer(US))).status_code \
                == 404
            report_eu_as_us = {**report, "region": "eu"}
            assert (await c.post("/v1/leases/lease-eu-000001/usage", json=report_eu_as_us,
                                 headers=bearer(US))).status_code == 403
            after = await reader.get_prefix(prefix.encode())
            assert [(kv.key, kv.mod_revision) for kv in after if b"/leader" not in kv.key] == \
                   [(kv.key, kv.mod_revision) for kv in before if b"/leader" not in kv.key]
            # probes stay open
            assert (await c.get("/healthz")).status_code == 200
            assert (await c.get("/metrics")).status_code == 200
    finally:
        await reader.close()


async def test_a_lease_ids_existence_does_not_leak_across_regions(etcd_cluster, tmp_path):
    """For another region's lease, a region gets exactly the answers it gets for
    a lease id nobody used (404, no 403; no 409 naming the other region's pool), and reusing the id
    is simply its own lease."""
    prefix = unique_prefix()
    bundle = write_pools(tmp_path / "b.json", [Pool(id="p1", window_ms=60_000, limit=100, chunk_max=50),
                                               Pool(id="p2", window_ms=60_000, limit=100, chunk_max=50)])
    settings = settings_for(etcd_cluster, bundle, prefix, auth_disabled=False,
                            region_tokens=[f"eu:{sha(EU)}", f"us:{sha(US)}"])
    async with in_process(settings) as c:
        assert (await c.post("/v1/leases", json=lease_body("secret-lease-01", "p2", "eu", 10),
                             headers=bearer(EU))).json()["granted"] == 10

        async def as_us(lease_id: str) -> list[tuple[int, str, str]]:
            report = {"leaseId": lease_id, "pool": "p1", "region": "us", "spent": 0}
            answers = [await c.get(f"/v1/leases/{lease_id}", headers=bearer(US)),
                       await c.post(f"/v1/leases/{lease_id}/usage", json=report, headers=bearer(US)),
                       await c.post(f"/v1/leases/{lease_id}/usage", json={**report, "pool": "p2"},
                                    headers=bearer(US))]
            return [(r.status_code, r.json()["type"], r.json()["detail"].replace(lease_id, "ID")) for r in answers]

        taken, unused = await as_us("secret-lease-01"), await as_us("never-used-001")
        assert taken == unused and {status for status, _, _ in taken} == {404}, (taken, unused)
        # the id is free for the other region: its own lease, not a 409 naming eu's pool p2
        mine = await c.post("/v1/leases", json=lease_body("secret-lease-01", "p1", "us", 3), headers=bearer(US))
        assert mine.status_code == 200 and (mine.json()["granted"], mine.json()["region"]) == (3, "us")
        theirs = (await c.get("/v1/leases/secret-lease-01", headers=bearer(EU))).json()
        assert (theirs["grant"]["pool"], theirs["grant"]["granted"]) == ("p2", 10)  # eu's lease untouched


# -- agent --------------------------------------------------------------------------------------
async def test_agent_gateway_and_operator_credentials(redis_url, policy_file):
    settings = make_settings(redis_url, policy_file, auth_disabled=False, gateway_tokens=[f"edge-1:{sha(GATEWAY)}"],
                             operator_tokens=[f"ops:{sha(OPERATOR)}"])
    r = redis.Redis.from_url(redis_url)
    async with AsyncTestClient(app=create_app(settings, pepper=PEPPER)) as agent:
        body = admit_body("auth-000001")
        first = assert_401(await agent.post("/v1/admit", json=body))
        assert first == {**assert_401(await agent.post("/v1/admit", json=body, headers=bearer("edge-guess"))),
                         "instance": "/v1/admit"}
        assert_401(await agent.post("/v1/admit", json=body, headers=bearer(OPERATOR)))  # wrong kind of token
        assert_401(await agent.post("/v1/admit/batch", json={"requests": [body]}))
        assert_401(await agent.post("/v1/release", json={"requestId": "auth-000001", "principal": body["principal"],
                                                         "routeGroup": "read", "tenantId": "atlas"}))
        assert_401(await agent.post("/v1/renew", json={"requestId": "auth-000001", "principal": body["principal"],
                                                       "routeGroup": "read", "tenantId": "atlas"}))
        assert_401(await agent.post("/v1/admit", content=b"{not json", headers={"content-type": "application/json"}))
        assert r.dbsize() == 0  # nothing reached Redis
        ok = await agent.post("/v1/admit", json=body, headers=bearer(GATEWAY))
        assert ok.status_code == 200 and ok.json()["allowed"]
        assert_401(await agent.get("/v1/policy"))
        assert_401(await agent.get("/v1/policy", headers=bearer(GATEWAY)))
        assert_401(await agent.get("/v1/leases", headers=bearer(GATEWAY)))
        assert (await agent.get("/v1/policy", headers=bearer(OPERATOR))).json()["bundleVersion"] > 0
        assert (await agent.get("/v1/leases", headers=bearer(OPERATOR))).status_code == 200
        unnamed = {**admit_body("auth-000002"), "tenantId": "zeta-corp"}  # a tenant the bundle does not name
        assert (await agent.post("/v1/admit", json=unnamed, headers=bearer(GATEWAY))).status_code == 200
        for path in ("/healthz", "/readyz", "/metrics"):
            resp = await agent.get(path)
            assert resp.status_code == 200
            assert PEPPER.decode() not in resp.text and "U-17" not in resp.text and "K1" not in resp.text
            assert "zeta-corp" not in resp.text  # request data never: only tenants the bundle names (docs/metrics.md)
            if path != "/metrics":
                assert "atlas" not in resp.text
        # /metrics labels are bounded values of the bundle: rule ids and the tenants it names (docs/metrics.md)
        assert 'tenant="other"' in resp.text


# -- the local topology (make run) ----------------------------------------------------------------
def test_local_topology_runs_with_auth_on_and_leaks_no_secret(tmp_path):
    """make run's topology: tokens, Redis ACLs and etcd auth on; then logs (debug level), metrics,
    probe and error bodies, Redis keys and etcd keys/values are scanned for every secret."""
    topo = LocalTopology(TopologySpec(run_dir=tmp_path / "run", policy=DEFAULT_POLICY, regions=("eu",), allocators=1,
                                 auth=True, policy_from_etcd=True, agent_args=("--log-level", "debug"),
                                 allocator_args=("--log-level", "debug"))).start(timeout=60)
    bodies: list[str] = []
    try:
        secrets = tmp_path / "run" / "secrets"
        assert oct(secrets.stat().st_mode & 0o777) == "0o700"
        assert all(oct(f.stat().st_mode & 0o777) == "0o600" for f in secrets.iterdir())
        agent = topo.agent_urls["eu"][0]
        body = admit_body("topo-000001", route="read")
        assert httpx.post(agent + "/v1/admit", json=body, timeout=5).status_code == 401
        d = httpx.post(agent + "/v1/admit", json=body, headers=topo.gateway_headers(), timeout=10).json()
        assert d["allowed"] and not d["fallback"], d  # global pools spent from leases the region got with its token
        alloc = topo.allocator_urls[0]
        lease = lease_body("lease-topo-00001", "global-read", "eu", 1)
        assert httpx.post(alloc + "/v1/leases", json=lease, timeout=5).status_code == 401
        eu_token = (secrets / "region-eu.token").read_text().strip()
        assert httpx.post(alloc + "/v1/leases", json={**lease, "region": "us"}, headers=bearer(eu_token),
                          timeout=5).status_code == 403
        view = httpx.get(agent + "/v1/leases", headers=topo.operator_headers(), timeout=5).json()
        assert any(b["pool"] == "global-read" for b in view["balances"]), msgspec.json.encode(view)
        # Redis with ACLs on: the default user needs its password; the agent's user cannot FLUSHALL
        port = topo.redis["eu"].port
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port).ping()
        agent_pw = (secrets / "redis-agent.password").read_text()
        with pytest.raises(redis.exceptions.NoPermissionError):
            redis.Redis(host="127.0.0.1", port=port, username="agent", password=agent_pw).flushall()
        # etcd with authentication on; an operator publishes with the publisher's credentials (the
        # allocator's cannot), agents follow
        ep = ",".join(topo.etcd.endpoints)
        newer = tmp_path / "newer.json"
        base = load_bundle_file(str(DEFAULT_POLICY))
        newer.write_bytes(encode_bundle(seal(msgspec.structs.replace(base, bundle_version=base.bundle_version + 1))))
        assert cli_main(["policy", "publish", str(newer), "--etcd", ep]) != 0  # no credentials: refused
        assert cli_main(["policy", "publish", str(newer), "--etcd", ep, "--etcd-user", "allocator",
                         "--etcd-password-file", str(secrets / "etcd-allocator.password")]) != 0
        assert cli_main(["policy", "publish", str(newer), "--etcd", ep, "--etcd-user", "publisher",
                         "--etcd-password-file", str(secrets / "etcd-publisher.password")]) == 0
        # without --etcd the CLI uses the running topology's etcd and the publisher's credentials
        assert cli_main(["--run-dir", str(tmp_path / "run"), "policy", "show"]) == 0
        deadline = time.monotonic() + 20
        while httpx.get(agent + "/v1/policy", headers=topo.operator_headers(), timeout=5).json()["bundleVersion"] \
                != base.bundle_version + 1:
            assert time.monotonic() < deadline, "agent did not follow the published bundle"
            time.sleep(0.1)
        # error bodies for wrong credentials, bad input and foreign regions
        for resp in (httpx.post(agent + "/v1/admit", json=body, headers=bearer(eu_token), timeout=5),
                     httpx.post(agent + "/v1/admit", content=b"{", headers=topo.gateway_headers(), timeout=5),
                     httpx.post(agent + "/v1/admit", json={**body, "tenantId": "x}{y"}, headers=topo.gateway_headers(),
                                timeout=5),
                     httpx.get(agent + "/v1/policy", headers=topo.gateway_headers(), timeout=5),
                     httpx.post(alloc + "/v1/leases", json={**lease, "region": "us"}, headers=bearer(eu_token),
                                timeout=5),
                     httpx.post(alloc + "/v1/leases", json={**lease, "want": -1}, headers=bearer(eu_token), timeout=5),
                     httpx.get(alloc + "/v1/leases/lease-topo-00001", headers=bearer(topo.secrets.gateway), timeout=5)):
            assert resp.status_code in (400, 401, 403, 404, 415, 422), resp.text
            bodies.append(resp.text)
        bodies += [httpx.get(u + "/metrics", timeout=5).text for u in (agent, alloc)]
        # the state file and what `leasehold status` prints (service URLs, never credentials)
        bodies.append((tmp_path / "run" / "topology.json").read_text())
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli_main(["--run-dir", str(tmp_path / "run"), "status"]) == 0
        assert "redis://127.0.0.1:" in out.getvalue()
        bodies.append(out.getvalue())
        bodies += [httpx.get(u + p, timeout=5).text for u in (agent, alloc) for p in ("/healthz", "/readyz")]
        # no process was given a token or password on its command line
        cmdlines = " ".join(" ".join(p.args) for p in [*topo.allocators, *topo.agents["eu"], topo.redis["eu"].proc])
        passwords = [f.read_text() for f in secrets.glob("*.password")]
        assert len(passwords) == 6
        for tok in (topo.secrets.gateway, topo.secrets.operator, eu_token, *passwords):
            assert tok not in cmdlines
        # what Redis and etcd hold: keys and values
        stored = topo.redis["eu"].cli("--scan") + "\n".join(
            topo.etcd.etcdctl("get", "", "--prefix", user=f"root:{(secrets / 'etcd-root.password').read_text()}")
            .splitlines())
        assert "rl:v3:" in stored and "/leasehold/" in stored
    finally:
        topo.stop()
    # the secrets never appear in logs, metrics, error bodies or stored keys/values
    logs = "\n".join(p.read_text(errors="replace") for p in (tmp_path / "run").rglob("*.log"))
    assert "policy bundle" in logs or "starting region agent" in logs  # the logs were captured
    leaks = {name: value for name, value in {
        "gateway": topo.secrets.gateway, "operator": topo.secrets.operator, "region-eu": eu_token,
        "pepper": (secrets / "pepper").read_text(), **{f.stem: f.read_text() for f in secrets.glob("*.password")}}.items()
        if any(value in text for text in (logs, stored, *bodies))}
    assert leaks == {}, f"secrets leaked: {sorted(leaks)}"
