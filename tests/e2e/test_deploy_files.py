"""deploy/: every file parses; every metric of the table
(docs/metrics.md, generated from the code) is exported by running services, and every dashboard
panel is backed by real series on a signed ``leasehold up`` topology. (That the dashboard and the
alert rules name only metrics and labels of the table: tests/unit/devtools/test_metrics_doc.py.)"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest
import yaml

from devtools.metrics_doc import all_rows
from kernel.bundle import load_bundle_file
from leasehold.local.gateways import PLACEHOLDER
from leasehold.local.topology import LocalTopology, TopologySpec

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def test_every_deploy_file_parses():
    files = sorted(p for p in DEPLOY.rglob("*") if p.is_file())
    assert files
    for path in files:
        text = path.read_text()
        if path.parent.name == "gateways":  # templates: parse them rendered (every ${NAME} filled)
            text = PLACEHOLDER.sub("1", text)
        if path.suffix in (".yml", ".yaml"):
            docs = [d for d in yaml.safe_load_all(text) if d is not None]
            assert docs, path
        elif path.suffix == ".json":
            json.loads(text)
        elif path.name == "Dockerfile":
            assert re.search(r"^FROM ", text, re.M) and "USER " in text
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    assert {"etcd-0", "etcd-1", "etcd-2", "allocator-1", "allocator-2", "agent-eu", "agent-us"} <= set(compose["services"])


# The Kubernetes manifests as rendered by kustomize, validated against the schemas, and the compose
# file as docker-compose reads it: tests/e2e/test_deploy_render.py.


@pytest.fixture(scope="module")
def topology(tmp_path_factory):
    """What ``make run`` starts (``leasehold up``): authentication on, policy from etcd, signed bundles."""
    topo = LocalTopology(TopologySpec(run_dir=tmp_path_factory.mktemp("deploy-topo"), regions=("eu",), allocators=1,
                                 auth=True, policy_from_etcd=True, signed=True)).start()
    yield topo
    topo.stop()


def drive(topo: LocalTopology) -> None:
    """A little of every kind of demo traffic: reads past P-READ (denials), Birch, an export,
    anonymous logins, the operators' probe (a bypass), a gateway naming a newer policyEpoch."""
    agent = topo.agent_urls["eu"][0]
    bodies = [{"tenantId": "atlas", "principal": {"type": "user", "id": "U-17", "apiKeyId": "K1"},
               "routeGroup": "read"}] * 25
    bodies += [{"tenantId": "birch", "principal": {"type": "user", "id": f"B-{i}"}, "routeGroup": "read"}
               for i in range(3)]
    bodies += [{"tenantId": "atlas", "principal": {"type": "user", "id": "U-2"}, "routeGroup": "export"},
               {"principal": {"type": "anonymous", "id": "203.0.113.9"}, "routeGroup": "login"},
               {"tenantId": "northstar-ops", "principal": {"type": "service", "id": "prober"}, "routeGroup": "probe"},
               {"tenantId": "zeta", "principal": {"type": "user", "id": "Z-1"}, "routeGroup": "read",
                "policyEpoch": 99}]
    with httpx.Client(timeout=5, headers=topo.gateway_headers()) as client:
        for i, b in enumerate(bodies):
            r = client.post(agent + "/v1/admit", json={"requestId": f"deploy-check-{i:04d}", **b})
            assert r.status_code == 200, r.text


def scrape(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=5).text


def samples(text: str) -> set[str]:
    """Metric names with at least one sample line."""
    return {line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_every_metric_of_the_table_is_exported_by_live_services(topology):
    drive(topology)
    agent, alloc = scrape(topology.agent_urls["eu"][0]), scrape(topology.allocator_urls[0])
    missing = []
    for row in all_rows():
        text = agent if row.service == "agent" else alloc
        if f"# TYPE {row.name} {row.type}" not in text:
            missing.append(row.name)
    assert not missing, f"in docs/metrics.md but not exported: {missing}"


def test_every_dashboard_panel_is_backed_by_real_series(topology):
    """On the signed ``leasehold up`` topology, after demo traffic, every panel has at least one query
    all of whose metrics have series (and every query names only metrics of the table)."""
    from devtools.deploy_check import HISTOGRAM_SUFFIXES, dashboard_queries, metric_names

    drive(topology)
    agent_url, alloc_url = topology.agent_urls["eu"][0], topology.allocator_urls[0]

    def live() -> set[str]:
        return samples(scrape(agent_url)) | samples(scrape(alloc_url))

    def backed(names: set[str], have: set[str]) -> bool:
        return all(n in have or any(n + s in have for s in HISTOGRAM_SUFFIXES) for n in names)

    panels = dashboard_queries()
    deadline = time.monotonic() + 30  # leases are granted and the pool balance read within a few ticks
    while True:
        have = live()
        empty = [title for title, qs in panels if not any(backed(metric_names(q.expr), have) for q in qs)]
        if not empty or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not empty, f"panels without series: {empty}"
    assert "leasehold_agent_bypass_decisions_total" in have and "leasehold_allocator_pool_window_granted_ratio" in have
    # the topology runs signed: its start bundle carries a signature the services verified
    assert load_bundle_file(str(topology.policy_path)).signature


def test_the_gateway_docs_link_the_files_the_tests_run():
    """docs/gateways.md links every file of deploy/gateways (the e2e tests render those files) and
    copies none of them, so no copy can drift from what is tested; compose's Envoy fills every
    placeholder of the file it mounts."""
    doc = (ROOT / "docs" / "gateways.md").read_text()
    files = sorted((DEPLOY / "gateways").iterdir())
    assert {p.name for p in files} == {"envoy-rls.yaml", "envoy-ext-authz.yaml", "envoy-rlqs.yaml", "nginx.conf",
                                       "traefik.yml"}
    for path in files:
        assert f"](../deploy/gateways/{path.name})" in doc, f"docs/gateways.md does not link {path.name}"
        first_lines = "\n".join(path.read_text().splitlines()[9:14])
        assert first_lines not in doc and first_lines not in (ROOT / "README.md").read_text()
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    envoy = compose["services"]["envoy-eu"]
    assert "./gateways/envoy-rls.yaml:/etc/envoy/envoy-rls.yaml.in:ro" in envoy["volumes"]
    needed = set(PLACEHOLDER.findall((DEPLOY / "gateways" / "envoy-rls.yaml").read_text()))
    from_env = needed - {"GATEWAY_TOKEN"}  # the token comes from its secret file in the command
    assert from_env <= set(envoy["environment"]), from_env - set(envoy["environment"])
    loop = next(line for line in envoy["command"][0].splitlines() if line.strip().startswith("for v in"))
    words = {w.rstrip(";") for w in loop.split()}
    assert needed <= words, needed - words
    assert compose["services"]["agent-eu"]["environment"]["LEASEHOLD_AGENT_RLS_PORT"] == "8089"


def _seconds(text: str) -> float:
    """An Envoy duration or an nginx time (``60s``, ``1m``, ``500ms``, a bare number of seconds)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)?", text.strip())
    assert match is not None, text
    return float(match.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3_600, None: 1}[match.group(2)]


# Traefik's ForwardAuth has no setting for its idle connections: pkg/middlewares/auth/forward.go
# (v3.0 to v3.7) builds an http.Client with no Transport (Go's DefaultTransport), or, with `tls`, a
# Clone() of it; DefaultTransport's IdleConnTimeout is 90 s (net/http/transport.go)
TRAEFIK_FORWARD_AUTH_IDLE_S = 90.0
# what a gateway's idle timeout stays below the agent's by: the agent's close may be late by a
# loaded event loop, the gateway's by its own timer wheel (decision 0093)
KEEPALIVE_MARGIN_S = 15.0


def test_every_shipped_gateway_closes_idle_connections_to_the_agent_before_the_agent_does():
    """A gateway that sends a request on a pooled connection the agent is closing at that moment
    gets no answer (Envoy's ext_authz then answers 503 for a healthy agent): each shipped gateway
    closes its idle connections to the agent's HTTP port at least ``KEEPALIVE_MARGIN_S`` before the
    agent's default ``--http-keepalive-s`` does (docs/gateways.md, "Idle connections"): Envoy and
    nginx by their written-out settings, Traefik's ForwardAuth by Go's 90 s, which no setting of
    its changes (the agent's default was 75 s, below it)."""
    import msgspec

    from allocator.settings import AllocatorSettings
    from region_agent.service.settings import AgentSettings
    keepalive_s = {f.name: f.default for f in msgspec.structs.fields(AgentSettings)}["http_keepalive_s"]
    assert {f.name: f.default for f in msgspec.structs.fields(AllocatorSettings)}["http_keepalive_s"] == keepalive_s

    def rendered(name: str) -> str:
        return PLACEHOLDER.sub("1", (DEPLOY / "gateways" / name).read_text())

    idle: dict[str, float] = {}
    envoy = yaml.safe_load(rendered("envoy-ext-authz.yaml"))
    authz = next(c for c in envoy["static_resources"]["clusters"] if c["name"] == "leasehold_authz")
    options = authz["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert options["explicit_http_config"] == {"http_protocol_options": {}}  # HTTP/1.1, as the agent's door
    idle["envoy-ext-authz.yaml leasehold_authz"] = _seconds(options["common_http_protocol_options"]["idle_timeout"])

    nginx = rendered("nginx.conf")
    upstream = re.search(r"upstream leasehold_agent \{(.*?)\}", nginx, re.S)
    assert upstream is not None
    timeout = re.search(r"^\s*keepalive_timeout\s+(\S+);", upstream.group(1), re.M)
    assert timeout is not None, "nginx's upstream keepalive_timeout is left to its default"
    idle["nginx.conf upstream leasehold_agent"] = _seconds(timeout.group(1))

    traefik = yaml.safe_load(rendered("traefik.yml"))
    forwards = {name: m["forwardAuth"] for name, m in traefik["http"]["middlewares"].items() if "forwardAuth" in m}
    assert forwards, "traefik.yml asks the agent through ForwardAuth"
    for name, forward in forwards.items():
        idle[f"traefik.yml {name}"] = TRAEFIK_FORWARD_AUTH_IDLE_S
        # and its check stays a GET without a body: should an operator set --http-keepalive-s below
        # 90 s, Go's client sends such a request again on a new connection when the agent closed it
        assert not forward.get("preserveRequestMethod") and not forward.get("forwardBody"), forward

    late = {where: s for where, s in idle.items() if s + KEEPALIVE_MARGIN_S > keepalive_s}
    assert not late, (f"these gateways keep idle connections to the agent within {KEEPALIVE_MARGIN_S} s of "
                      f"the agent's --http-keepalive-s ({keepalive_s} s) or longer: {late}")


def test_the_deploy_manifests_create_the_etcd_roles_with_the_script_leasehold_up_runs():
    """One definition of the etcd roles (deploy/etcd/leasehold-roles.sh): the package ships it for
    `leasehold up`, the Kubernetes Job and compose's etcd-init run it; services get only their own
    etcd user (the allocator 'allocator', agents 'agent'), never root's or the publisher's."""
    from leasehold.local.procs import etcd_roles_script

    script = DEPLOY / "etcd" / "leasehold-roles.sh"
    assert etcd_roles_script().resolve() == script.resolve()
    text = script.read_text()
    for role in ("leasehold-publisher", "leasehold-allocator", "leasehold-agent"):
        assert f"ensure_role {role}" in text
    assert 'grant leasehold-publisher readwrite "${P}policy/current"\n' in text
    assert "grant leasehold-allocator read \"${P}policy/\" prefix" in text
    kust = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    assert "etcd-roles-job.yaml" in kust["resources"]
    gen = {g["name"]: g["files"] for g in kust["configMapGenerator"]}
    # a copy inside the kustomize root, kept identical (tests/e2e/test_deploy_render.py)
    assert gen["leasehold-etcd-roles"] == ["leasehold-roles.sh=etcd/leasehold-roles.sh"]
    docs = [d for p in (DEPLOY / "k8s").glob("*.yaml") for d in yaml.safe_load_all(p.read_text()) if d]
    (job,) = [d for d in docs if d["kind"] == "Job"]
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["sh", "/opt/leasehold/leasehold-roles.sh"]
    # the script runs in the services' own image, which carries etcdctl from the etcd release the
    # deployments run (a third-party image with a shell and etcdctl can stop being published)
    (service_image,) = {d["spec"]["template"]["spec"]["containers"][0]["image"] for d in docs
                        if d["kind"] == "Deployment"}
    assert c["image"] == service_image
    etcd_images = set(re.findall(r"image: (\S+)", (ROOT / "deploy" / "k8s-dev" / "etcd.yaml").read_text()))
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^COPY --from=(\S+) /usr/local/bin/etcdctl /usr/local/bin/etcdctl$", dockerfile, re.M)[1] \
        in etcd_images
    job_vols = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    assert job_vols["script"]["configMap"]["name"] == "leasehold-etcd-roles"
    assert job_vols["passwords"]["secret"]["secretName"] == "leasehold-etcd-users"
    dev = yaml.safe_load((ROOT / "deploy" / "k8s-dev" / "kustomization.yaml").read_text())
    users = {g["name"]: g["files"] for g in dev["secretGenerator"]}["leasehold-etcd-users"]
    assert {f.split("=", 1)[0] for f in users} == {"root", "publisher", "allocator", "agent"}
    for d in (d for d in docs if d["kind"] == "Deployment"):
        pod = d["spec"]["template"]["spec"]
        spec = pod["containers"][0]
        etcd_keys = [i["key"] for v in pod["volumes"] if v.get("secret", {}).get("secretName") == "leasehold-etcd-users"
                     for i in v["secret"]["items"]]
        assert etcd_keys and not set(etcd_keys) & {"root", "publisher"}  # only its own password
        if d["metadata"]["name"] == "allocator":
            assert spec["args"][spec["args"].index("--etcd-user") + 1] == "allocator"
            assert etcd_keys == ["allocator"]
        else:
            env = {e["name"]: e for e in spec["env"]}
            assert env["LEASEHOLD_AGENT_POLICY_ETCD_USER"]["value"] == "agent"
            assert etcd_keys == ["agent"]
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    init = compose["etcd-init"]
    assert init["command"] == ["sh", "/opt/leasehold/leasehold-roles.sh"]
    assert init["image"] == compose["allocator-1"]["image"] == service_image
    assert "./etcd/leasehold-roles.sh:/opt/leasehold/leasehold-roles.sh:ro" in init["volumes"]
    for name in ("allocator-1", "allocator-2"):
        assert compose[name]["depends_on"]["etcd-init"]["condition"] == "service_completed_successfully"
        assert compose[name]["environment"]["LEASEHOLD_ALLOCATOR_ETCD_USER"] == "allocator"
    for name in ("agent-eu", "agent-us"):
        assert compose[name]["environment"]["LEASEHOLD_AGENT_POLICY_ETCD_USER"] == "agent"
        assert not any("root" in v or "publisher" in v for v in compose[name]["secrets"])


def test_the_etcd_roles_script_is_safe_to_rerun_against_a_live_cluster(tmp_path):
    """The Job, compose's etcd-init and `leasehold up` re-run the roles script against an etcd whose
    services are running: a re-run never refuses them a permission they keep (it used to delete
    and re-add every role, which revokes it from its users: the agents' policy reads were refused
    while it ran), and it still leaves each role exactly its grants (a permission an older
    script granted is revoked; a readwrite one that is now read is lowered)."""
    import os
    import secrets
    import subprocess
    import threading

    from leasehold.local.procs import ETCD_USERS, EtcdCluster

    cluster = EtcdCluster(tmp_path / "etcd", members=1).start()
    try:
        pw = {u: secrets.token_urlsafe(12) for u in ETCD_USERS}
        files = {}
        for user, password in pw.items():
            files[user] = tmp_path / f"{user}.password"
            files[user].write_text(password)
        cluster.apply_roles(files)
        env = {**os.environ, "ETCDCTL_API": "3", "ETCDCTL_ENDPOINTS": ",".join(cluster.endpoints)}
        env.pop("ETCDCTL_USER", None)

        def ctl(user: str, *args: str) -> subprocess.CompletedProcess:
            return subprocess.run(["etcdctl", "--command-timeout=20s", "--user", f"{user}:{pw[user]}", *args], env=env,
                                  capture_output=True,
                                  text=True, timeout=30)

        assert ctl("root", "put", "/leasehold/policy/current", "{}").returncode == 0
        # what an older script might have left: wider and extra permissions
        for extra in (["readwrite", "/leasehold/policy/", "--prefix=true"], ["read", "/leasehold/pools/", "--prefix=true"],
                      ["write", "/leasehold/a", "/leasehold/b"], ["read", "/leasehold/zz", "--from-key=true"],
                      ["read", "/leasehold/shards"]):
            assert ctl("root", "role", "grant-permission", "leasehold-agent", *extra).returncode == 0, extra
        refused: list[str] = []
        reads = 0
        stop = threading.Event()

        def agent_reads() -> None:
            nonlocal reads
            while not stop.is_set():
                r = ctl("agent", "get", "/leasehold/policy/current")
                if r.returncode == 0:
                    reads += 1
                elif "permission denied" in r.stderr:  # (a read slower than etcdctl's deadline on a
                    refused.append(r.stderr.strip()[-120:])  # busy machine is no refusal)

        reader = threading.Thread(target=agent_reads)
        reader.start()
        try:
            for _ in range(3):
                cluster.apply_roles(files)
        finally:
            stop.set()
            reader.join()
        assert reads > 3 and not refused, f"{len(refused)} agent reads refused during a re-run ({reads} answered): {refused[:1]}"
        got = ctl("root", "role", "get", "leasehold-agent").stdout.split("KV Write:")
        assert got[0].split("KV Read:")[1].split() == ["[/leasehold/policy/,", "/leasehold/policy0)", "(prefix",
                                                       "/leasehold/policy/)"], got
        assert got[1].split() == [], got  # agents write nothing
        assert ctl("agent", "put", "/leasehold/policy/current", "x").returncode != 0
        assert ctl("allocator", "put", "/leasehold/pools/p/0", "x").returncode == 0
    finally:
        cluster.stop()
