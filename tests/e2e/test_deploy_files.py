"""deploy/: every file parses, the manifests carry probes/resources/PDBs, and every metric the
dashboard and the alert rules name is actually exported by running services."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import yaml

from leasehold.gateways import PLACEHOLDER
from leasehold.topology import Topology, TopologySpec

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
METRIC_RE = re.compile(r"\bleasehold_[a-z0-9_]+")


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


def test_kubernetes_manifests_have_probes_resources_and_disruption_budgets():
    docs = []
    for path in (DEPLOY / "k8s").glob("*.yaml"):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    pdbs = {d["metadata"]["name"] for d in docs if d["kind"] == "PodDisruptionBudget"}
    assert {d["metadata"]["name"] for d in deployments} <= pdbs
    for d in deployments:
        (c,) = d["spec"]["template"]["spec"]["containers"]
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    secrets = [d for d in docs if d["kind"] == "Secret"]
    assert any("pepper" in s["stringData"] for s in secrets)
    agent = next(d for d in deployments if d["metadata"]["name"].startswith("agent"))
    env = {e["name"]: e for e in agent["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "secretKeyRef" in env["LEASEHOLD_AGENT_PEPPER"]["valueFrom"]  # the pepper comes from a Secret
    # authentication stays on in production: token digests from Secrets, never --auth-disabled
    assert "secretKeyRef" in env["LEASEHOLD_AGENT_GATEWAY_TOKENS"]["valueFrom"]
    alloc = next(d for d in deployments if d["metadata"]["name"] == "allocator")
    alloc_env = {e["name"]: e for e in alloc["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "secretKeyRef" in alloc_env["LEASEHOLD_ALLOCATOR_REGION_TOKENS"]["valueFrom"]
    text = "".join(p.read_text() for p in DEPLOY.rglob("*") if p.is_file())
    assert "auth-disabled" not in text and "AUTH_DISABLED" not in text


def referenced_metrics() -> set[str]:
    text = (DEPLOY / "prometheus" / "alerts.yml").read_text()
    text += (DEPLOY / "grafana" / "leasehold-dashboard.json").read_text()
    return set(METRIC_RE.findall(text))


@pytest.fixture(scope="module")
def topology(tmp_path_factory):
    topo = Topology(TopologySpec(run_dir=tmp_path_factory.mktemp("deploy-topo"), regions=("eu",), allocators=1)).start()
    yield topo
    topo.stop()


def test_every_metric_in_dashboard_and_alerts_is_exported(topology):
    agent = topology.agent_urls["eu"][0]
    with httpx.Client(timeout=5) as client:
        for i in range(3):  # populate lease and decision metrics
            client.post(agent + "/v1/admit", json={"requestId": f"deploy-check-{i:04d}", "tenantId": "atlas",
                                                   "principal": {"type": "user", "id": "U-1"}, "routeGroup": "read",
                                                   "method": "GET"})
        scraped = client.get(agent + "/metrics").text + client.get(topology.allocator_urls[0] + "/metrics").text
    exported = set(METRIC_RE.findall(scraped))
    missing = []
    for name in sorted(referenced_metrics()):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        if name not in exported and base not in exported:
            missing.append(name)
    assert not missing, f"named in deploy/ but not exported: {missing}"
    assert len(referenced_metrics()) >= 20


def test_readme_shows_the_gateway_files_the_tests_run():
    """README "Gateways" carries deploy/gateways/* verbatim (the e2e tests render those files)."""
    readme = (ROOT / "README.md").read_text()
    files = sorted((DEPLOY / "gateways").iterdir())
    assert {p.name for p in files} == {"envoy-rls.yaml", "envoy-ext-authz.yaml", "nginx.conf", "traefik.yml"}
    for path in files:
        assert path.read_text() in readme, f"README's copy of {path.name} differs from the file"
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    envoy = compose["services"]["envoy-eu"]
    assert "./gateways/envoy-rls.yaml:/etc/envoy/envoy-rls.yaml.in:ro" in envoy["volumes"]
    assert compose["services"]["agent-eu"]["environment"]["LEASEHOLD_AGENT_RLS_PORT"] == "8089"
