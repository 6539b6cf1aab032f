"""deploy/ as an operator uses it: ``kubectl kustomize deploy/k8s`` renders from a fresh clone and
the result validates against the Kubernetes schemas (``kubernetes-validate``, strict: unknown
fields are errors) for the oldest and newest Kubernetes we support; the dev overlay renders and
validates with the Secrets generated from ``leasehold secrets generate``; the compose file passes
``docker-compose config`` (Debian's docker-compose, which needs no engine) and mounts exactly the
files that command writes. docs/decisions/0003-deploy-validation.md says why these tools."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from leasehold.commands.secrets import file_names, generate
from tests.support.manifests import DEPLOY, bind_mount, by_kind, kustomize

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSIONS = ("1.29.0", "1.37.0")  # the oldest and newest Kubernetes the manifests are checked against


def validate(docs: list[dict]) -> None:
    errors = []
    for version in K8S_VERSIONS:
        for d in docs:
            try:
                kubernetes_validate.validate(d, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                errors.append(f"{version} {d['kind']}/{d['metadata']['name']}: {e.message}")
    assert not errors, "\n".join(errors)


@pytest.fixture(scope="module")
def dev_overlay(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """deploy/ copied (kustomize reads nothing outside a root), secrets generated into the overlay."""
    copy = tmp_path_factory.mktemp("deploy") / "deploy"
    shutil.copytree(DEPLOY, copy, ignore=shutil.ignore_patterns("secrets"))
    generate(copy / "k8s-dev" / "secrets")
    return kustomize(copy / "k8s-dev")


def test_the_validator_refuses_what_kubernetes_would():
    """The check can fail: a wrong type and an unknown field are reported."""
    (dep,) = [d for d in kustomize(DEPLOY / "k8s") if d["kind"] == "Deployment" and d["metadata"]["name"] == "allocator"]
    dep["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSIONS[0], strict=True)
    dep["spec"]["replicas"] = 2
    dep["spec"]["template"]["spec"]["terminationGracePeriod"] = 30
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSIONS[0], strict=True)


def test_the_base_renders_validates_and_carries_no_secret():
    docs = kustomize(DEPLOY / "k8s")
    validate(docs)
    assert not by_kind(docs, "Secret"), "the base must never carry a Secret: an apply would overwrite real ones"
    assert all(d["metadata"].get("namespace") == "leasehold" for d in docs if d["kind"] != "Namespace")
    deployments = by_kind(docs, "Deployment")
    assert set(deployments) == {"agent-eu", "allocator"}
    pdbs = by_kind(docs, "PodDisruptionBudget")
    for name, d in deployments.items():
        spec = d["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        assert c["resources"]["limits"]["memory"]
        assert {t["topologyKey"] for t in spec["topologySpreadConstraints"]} == \
            {"topology.kubernetes.io/zone", "kubernetes.io/hostname"}
        assert spec["securityContext"]["runAsNonRoot"] is True
        selector = d["spec"]["selector"]["matchLabels"]
        assert any(p["spec"]["selector"]["matchLabels"] == selector for p in pdbs.values()), name
        # every credential from a Secret volume (files), never a literal in the manifest
        env = {e["name"]: e for e in c["env"]}
        for key, e in env.items():
            if "PASSWORD" in key or "TOKEN" in key or "PEPPER" in key:
                assert key.endswith("_FILE") and e["value"].startswith("/run/secrets/"), key
        secret_vols = {v["name"] for v in spec["volumes"] if "secret" in v}
        assert {m["name"] for m in c["volumeMounts"] if m["mountPath"].startswith("/run/secrets")} == secret_vols
    agent = deployments["agent-eu"]["spec"]["template"]["spec"]["containers"][0]
    assert {p["name"]: p["containerPort"] for p in agent["ports"]} == {"http": 8080, "rls": 8089}
    assert agent["args"][agent["args"].index("--rls-port") + 1] == "8089"
    services = by_kind(docs, "Service")
    assert {p["name"] for p in services["agent-eu"]["spec"]["ports"]} == {"http", "rls"}
    assert services["agent-eu-rls"]["spec"]["clusterIP"] == "None"  # Envoy STRICT_DNS sees every agent
    text = yaml.safe_dump_all(docs)
    assert "auth-disabled" not in text and "AUTH_DISABLED" not in text and "insecure-dev-pepper" not in text


# where a container names etcd's endpoints and the CA it verifies etcd with
ETCD_ENDPOINT_NAMES = ("--etcd", "LEASEHOLD_AGENT_POLICY_ETCD", "LEASEHOLD_ALLOCATOR_ETCD", "ETCDCTL_ENDPOINTS")
ETCD_CA_NAMES = ("--etcd-ca-file", "LEASEHOLD_AGENT_POLICY_ETCD_CA_FILE", "LEASEHOLD_ALLOCATOR_ETCD_CA_FILE",
                 "ETCDCTL_CACERT")


def _etcd_settings(c: dict) -> tuple[list[str], list[str]]:
    """A container's etcd endpoint lists and CA files, from its args (``--flag value``) and env."""
    args = c.get("args", [])
    named = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--")}
    named |= {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    return ([named[n] for n in ETCD_ENDPOINT_NAMES if n in named], [named[n] for n in ETCD_CA_NAMES if n in named])


def test_every_etcd_client_of_the_base_speaks_tls_and_verifies_etcd_with_the_mounted_ca():
    """The passwords and every lease and policy cross the network to etcd: the base names only
    https:// etcd endpoints, and each container that names them (the allocator, the agents, the
    roles Job) verifies etcd with the CA file of Secret leasehold-etcd-ca, mounted 0440 (the base's
    clients used to talk plaintext to etcd-N.etcd:2379 and mount no CA)."""
    docs = kustomize(DEPLOY / "k8s")
    clients = {}
    for kind in ("Deployment", "Job"):
        for name, d in by_kind(docs, kind).items():
            spec = d["spec"]["template"]["spec"]
            (c,) = spec["containers"]
            endpoints, cas = _etcd_settings(c)
            text = yaml.safe_dump(c)
            if "etcd-0.etcd" not in text:
                continue
            clients[name] = endpoints
            assert endpoints, f"{name} names etcd where this test does not look"
            for e in ",".join(endpoints).split(","):
                assert e.startswith("https://etcd-"), f"{name}: etcd endpoint {e!r} is not TLS"
            (ca,) = cas
            volumes = {v["name"]: v for v in spec["volumes"]}
            (mount,) = [m for m in c["volumeMounts"] if ca.startswith(m["mountPath"] + "/")]
            secret = volumes[mount["name"]]["secret"]
            assert secret["secretName"] == "leasehold-etcd-ca" and secret["defaultMode"] == 0o440, name
            keys = {i["path"]: i["key"] for i in secret.get("items", [])} or {"ca.crt": "ca.crt"}
            assert keys[ca[len(mount["mountPath"]) + 1:]] == "ca.crt", name
    assert set(clients) == {"allocator", "agent-eu", "leasehold-etcd-roles"}


def test_the_dev_overlay_adds_redis_etcd_and_generated_secrets(dev_overlay: list[dict]):
    validate(dev_overlay)
    secrets = by_kind(dev_overlay, "Secret")
    # hashed names: an apply creates new Secrets and never overwrites the ones in use
    assert {n.rsplit("-", 1)[0] for n in secrets} == {"leasehold-agent-eu", "leasehold-allocator",
                                                       "leasehold-etcd-users", "leasehold-etcd-ca",
                                                       "leasehold-etcd-server", "leasehold-redis-eu"}
    referenced = set()
    for kind in ("Deployment", "StatefulSet", "Job"):
        for d in by_kind(dev_overlay, kind).values():
            referenced |= {v["secret"]["secretName"] for v in d["spec"]["template"]["spec"].get("volumes", [])
                           if "secret" in v}
    assert referenced == set(secrets), "every workload references a generated Secret by its hashed name"
    (etcd,) = by_kind(dev_overlay, "StatefulSet").values()
    assert etcd["spec"]["replicas"] == 3 and etcd["spec"]["serviceName"] == "etcd"
    assert by_kind(dev_overlay, "Service")["etcd"]["spec"]["clusterIP"] == "None"
    assert "redis-eu" in by_kind(dev_overlay, "Deployment")
    assert {"etcd", "agent-eu", "allocator"} <= set(by_kind(dev_overlay, "PodDisruptionBudget"))
    # the agent's Redis user is the one the generated ACL file defines
    agent = by_kind(dev_overlay, "Deployment")["agent-eu"]["spec"]["template"]["spec"]["containers"][0]
    assert "redis://agent@redis-eu:6379/0" in agent["args"]
    # private keys never enter the cluster: not the policy-signing key, not the development
    # identity provider's (generated beside the Secrets' files, for `leasehold token`), not etcd's
    # CA's; the one private key in the overlay is etcd's own, in the Secret only etcd mounts
    (server,) = [n for n in secrets if n.startswith("leasehold-etcd-server-")]
    assert set(secrets[server]["data"]) == {"ca.crt", "server.crt", "server.key"}
    mounting = {name for kind in ("Deployment", "StatefulSet", "Job") for name, d in by_kind(dev_overlay, kind).items()
                if any(v.get("secret", {}).get("secretName") == server for v in d["spec"]["template"]["spec"]["volumes"])}
    assert mounting == {"etcd"}
    text = yaml.safe_dump_all([d for d in dev_overlay if d["metadata"]["name"] != server])
    assert "PRIVATE KEY" not in text and "LS0tLS1CRUdJTiBQUklWQVRF" not in text  # PEM, plain or base64


def test_the_base_carries_current_copies_of_the_bundle_and_the_roles_script():
    """kustomize reads no file outside deploy/k8s: the base holds copies, kept identical here."""
    assert (DEPLOY / "k8s" / "policy" / "bundle.json").read_bytes() == \
        (ROOT / "policies" / "northstar-global.json").read_bytes(), \
        "cp policies/northstar-global.json deploy/k8s/policy/bundle.json"
    assert (DEPLOY / "k8s" / "etcd" / "leasehold-roles.sh").read_bytes() == \
        (DEPLOY / "etcd" / "leasehold-roles.sh").read_bytes(), \
        "cp deploy/etcd/leasehold-roles.sh deploy/k8s/etcd/leasehold-roles.sh"


def test_compose_validates_and_mounts_exactly_the_generated_secrets(tmp_path: Path):
    compose_bin = shutil.which("docker-compose")
    if compose_bin is None:
        pytest.fail("docker-compose is missing: `make test` installs it (Debian package docker-compose)")
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy, ignore=shutil.ignore_patterns("secrets"))
    (tmp_path / "policies").mkdir()
    shutil.copy(ROOT / "policies" / "northstar-global.json", tmp_path / "policies")
    generate(copy / "secrets")
    r = subprocess.run([compose_bin, "-f", str(copy / "docker-compose.yml"), "config"], capture_output=True,
                       text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    resolved = yaml.safe_load(r.stdout)
    declared = resolved["secrets"]
    for name, spec in declared.items():
        assert Path(spec["file"]).is_file(), f"secret {name}: {spec['file']} is not written by leasehold secrets generate"
        assert Path(spec["file"]).name in file_names(("eu", "us"))
    for name, svc in resolved["services"].items():
        for ref in svc.get("secrets", []):
            source = ref if isinstance(ref, str) else ref["source"]
            assert source in declared, f"service {name} mounts undeclared secret {source}"
        env = svc.get("environment", {}) or {}
        for key, value in env.items():
            if key.endswith("_FILE") and str(value).startswith("/run/secrets/"):
                mounted = {(s if isinstance(s, str) else s["source"]) for s in svc.get("secrets", [])}
                assert Path(value).name in mounted, f"{name}: {key} names a file it does not mount"
    # Envoy's JWKS: unset JWKS_FILE is the development identity provider's JWKS the generator wrote
    # (its key id says so); the provider's private key is mounted into no service
    envoy = resolved["services"]["envoy-eu"]
    (jwks_mount,) = [m for m in map(bind_mount, envoy["volumes"]) if m[1] == "/etc/envoy/jwks.json"]
    assert Path(jwks_mount[0]) == copy / "secrets" / "jwks.json" and jwks_mount[2]
    keys = json.loads(Path(jwks_mount[0]).read_text())["keys"]
    assert len(keys) == 1 and keys[0]["kid"].startswith("dev-") and "d" not in keys[0]  # public only
    for name, svc in resolved["services"].items():
        sources = [bind_mount(v)[0] for v in svc.get("volumes", []) or []]
        assert not any(s.endswith(".key") for s in sources), f"{name} mounts a private key"
    # etcd over TLS only, as in the base: every etcd endpoint https://, each client verifies etcd
    # with the generated CA it mounts, and etcd serves TLS on both ports (decision 0069)
    clients = set()
    for name, svc in resolved["services"].items():
        env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
        cmd = [str(w) for w in svc.get("command") or []]
        endpoints, cas = _etcd_settings({"args": cmd, "env": [{"name": k, "value": v} for k, v in env.items()]})
        if not endpoints:
            continue
        clients.add(name)
        assert all(e.startswith("https://etcd-") for e in ",".join(endpoints).split(",")), (name, endpoints)
        assert cas == ["/run/secrets/etcd-ca.crt"] and "etcd-ca.crt" in {
            s if isinstance(s, str) else s["source"] for s in svc["secrets"]}, name
    assert clients == {"etcd-init", "allocator-1", "allocator-2", "agent-eu", "agent-us"}
    for i in range(3):
        env = resolved["services"][f"etcd-{i}"]["environment"]
        assert all(env[k].startswith("https://") for k in ("ETCD_LISTEN_CLIENT_URLS", "ETCD_LISTEN_PEER_URLS",
                                                              "ETCD_ADVERTISE_CLIENT_URLS",
                                                              "ETCD_INITIAL_ADVERTISE_PEER_URLS"))
        assert "http://" not in env["ETCD_INITIAL_CLUSTER"] and env["ETCD_PEER_CLIENT_CERT_AUTH"] == "true"
    # tracing off unless a collector is named: 0 % sampled
    assert envoy["environment"]["TRACE_SAMPLE_PERCENT"] == "0"
    # every container of Leasehold's image locked down as the Kubernetes pods are: a read-only root
    # file system with /tmp a tmpfs (the pods' emptyDir), no capability, no privilege to gain
    # (tests/e2e/test_deploy_run.py runs them so and reads their /proc)
    ours = {name for name, svc in resolved["services"].items() if str(svc.get("image", "")).startswith("leasehold:")}
    assert ours == {"etcd-init", "allocator-1", "allocator-2", "agent-eu", "agent-us", "upstream"}
    for name in sorted(ours):
        svc = resolved["services"][name]
        assert svc.get("read_only") is True, f"{name}: its root file system is writable"
        tmpfs = svc.get("tmpfs") or []
        assert [t.split(":")[0] for t in ([tmpfs] if isinstance(tmpfs, str) else tmpfs)] == ["/tmp"], name
        assert svc.get("cap_drop") == ["ALL"], f"{name} keeps the engine's default capabilities"
        assert "no-new-privileges:true" in (svc.get("security_opt") or []), name
        assert "cap_add" not in svc and not svc.get("privileged") and "user" not in svc, name  # the image's USER
    # a broken file is refused by the same tool (the check can fail)
    bad = copy / "docker-compose.yml"
    bad.write_text(bad.read_text().replace("    restart: on-failure\n", "    restart: on-failure\n    restartt: no\n"))
    r = subprocess.run([compose_bin, "-f", str(bad), "config", "-q"], capture_output=True, text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert r.returncode != 0 and "restartt" in r.stderr


def _pods(docs: list[dict]) -> dict[str, dict]:
    return {f"{d['kind']}/{d['metadata']['name']}": d["spec"]["template"]["spec"] for d in docs
            if d["kind"] in ("Deployment", "StatefulSet", "Job")}


def test_every_container_is_locked_down(dev_overlay: list[dict]):
    """Restricted pod security for every workload, the dev overlay's Redis and etcd included:
    non-root, no service account token, the runtime's default seccomp profile, no privilege
    escalation, no capability, a read-only root file system (docs/deployment.md says so of every one; tests/e2e/test_deploy_run.py
    runs them so)."""
    base = {name for name in _pods(kustomize(DEPLOY / "k8s"))}
    assert base == {"Deployment/agent-eu", "Deployment/allocator", "Job/leasehold-etcd-roles"}
    for name, pod in _pods(dev_overlay).items():
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        # none of them calls the Kubernetes API: no service account token for a compromised process
        assert pod.get("automountServiceAccountToken") is False, name
        assert pod["securityContext"].get("seccompProfile") == {"type": "RuntimeDefault"}, name
        for c in pod["containers"]:
            sc = c.get("securityContext", {})
            assert sc.get("allowPrivilegeEscalation") is False, name
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], name
            assert sc.get("readOnlyRootFilesystem") is True, name


def test_services_start_with_a_startup_probe_and_liveness_never_follows_the_stores():
    """Start-up (bundle, Redis INFO, the first etcd read, lease warm-up) is covered by a startup
    probe, so the liveness probe cannot restart a process that is still starting; liveness and
    readiness read endpoints that never consult Redis or etcd."""
    for name, pod in _pods(kustomize(DEPLOY / "k8s")).items():
        if name.startswith("Job/"):
            continue
        (c,) = pod["containers"]
        start = c["startupProbe"]
        assert start["httpGet"]["path"] == "/healthz"
        assert start["periodSeconds"] * start["failureThreshold"] >= 60, name
        for probe in ("livenessProbe", "readinessProbe"):
            assert c[probe]["httpGet"]["path"] in ("/healthz", "/readyz"), name


def _allows(policy: dict, labels: dict[str, str], port: str) -> bool:
    """Whether ``policy`` lets a pod of ``labels`` (the same namespace) reach ``port``."""
    for rule in policy["spec"].get("ingress", []):
        ports = {p["port"] for p in rule.get("ports", [])}
        if ports and port not in ports:
            continue
        for peer in rule.get("from", []):
            want = peer.get("podSelector", {}).get("matchLabels", {})
            if "ipBlock" not in peer and all(labels.get(k) == v for k, v in want.items()):
                return True
    return False


def test_the_allocator_api_is_reachable_only_from_agents_and_scrapers():
    """The allocator's HTTP port (lease calls, and the unauthenticated /v1/pools, /v1/leader and
    /metrics) is reachable from the region agents and from pods labelled as metric scrapers,
    from no other pod (decision 0057)."""
    docs = kustomize(DEPLOY / "k8s")
    policies = by_kind(docs, "NetworkPolicy")
    selecting = [p for p in policies.values()
                 if p["spec"]["podSelector"].get("matchLabels") == {"app.kubernetes.io/name": "leasehold-allocator"}]
    assert len(selecting) == 1, "one NetworkPolicy selects the allocator pods"
    (policy,) = selecting
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    agent = by_kind(docs, "Deployment")["agent-eu"]["spec"]["template"]["metadata"]["labels"]
    assert _allows(policy, agent, "http")
    assert _allows(policy, {"leasehold/scrape": "true"}, "http")
    for other in ({}, {"app.kubernetes.io/name": "some-app"}, {"app.kubernetes.io/name": "leasehold-allocator"}):
        assert not _allows(policy, other, "http"), other
    scrape = [peer for rule in policy["spec"]["ingress"] for peer in rule["from"]
              if peer.get("podSelector", {}).get("matchLabels") == {"leasehold/scrape": "true"}]
    assert scrape and all(peer.get("namespaceSelector") == {} for peer in scrape)  # Prometheus in any namespace
    port = {p["name"]: p["containerPort"] for p in
            by_kind(docs, "Deployment")["allocator"]["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert port == {"http": 8080}


def test_the_agents_ports_are_reachable_only_from_labelled_gateways_and_scrapers():
    """The agents' HTTP port (/v1/admit, /v1/authz, /v1/release, /v1/renew with the gateway token;
    the unauthenticated /metrics and schema) only from pods labelled ``leasehold/gateway: "true"``
    and ``leasehold/scrape: "true"``, in any namespace; their RLS port (RLS, RLQS) only from the
    gateways. One NetworkPolicy of the base selects the agent pods (the Deployment's pod labels),
    ingress only, its ports named as the container names them (decision 0094). Checked with
    NetworkPolicy's semantics on ``kubectl kustomize deploy/k8s``; the base used to leave the agents
    open to every pod of the cluster."""
    docs = kustomize(DEPLOY / "k8s")
    policies = list(by_kind(docs, "NetworkPolicy").values())
    agent = _pod_refs(docs)["agent-eu"]
    selecting = [p for p in policies if _selects(p["spec"]["podSelector"], agent.labels)]
    assert len(selecting) == 1, "one NetworkPolicy selects the agent pods"
    (policy,) = selecting
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert dict(agent.ports) == {"http": 8080, "rls": 8089}
    named = {p["port"] for rule in policy["spec"]["ingress"] for p in rule.get("ports", [])}
    assert named == {"http", "rls"}, "the policy names the container's ports"
    # the pods it selects are the agents of its region only (a copy per region: agent-<region>)
    assert not _selects(policy["spec"]["podSelector"], {**agent.labels, "leasehold/region": "us"})
    assert not _selects(policy["spec"]["podSelector"], _pod_refs(docs)["allocator"].labels)
    peers = {"gateway": PodRef({"app.kubernetes.io/name": "envoy", "leasehold/gateway": "true"}, namespace="edge"),
             "gateway-here": PodRef({"app.kubernetes.io/name": "nginx", "leasehold/gateway": "true"}),
             "backend": PodRef({"app.kubernetes.io/name": "reports", "leasehold/gateway": "true"}, namespace="apps"),
             "prometheus": PodRef({"app.kubernetes.io/name": "prometheus", "leasehold/scrape": "true"},
                                  namespace="monitoring"),
             "unlabelled-gateway": PodRef({"app.kubernetes.io/name": "envoy"}, namespace="edge"),
             "gateway-false": PodRef({"app.kubernetes.io/name": "envoy", "leasehold/gateway": "false"}),
             "stranger": PodRef({"app.kubernetes.io/name": "some-app"}),
             "allocator": _pod_refs(docs)["allocator"],
             "other-agent": agent}
    got = {port: {name for name, src in peers.items() if reachable(policies, src, agent, port)}
           for port in (8080, 8089)}
    assert got == {8080: {"gateway", "gateway-here", "backend", "prometheus"},
                   8089: {"gateway", "gateway-here", "backend"}}
    # the check can fail: without the policy every pod reaches both ports
    others = [p for p in policies if p is not policy]
    assert all(reachable(others, src, agent, port) for src in peers.values() for port in (8080, 8089))

def test_the_kubernetes_scrape_configuration_matches_the_base_and_the_alerts():
    """deploy/prometheus/prometheus-k8s.yml: its jobs are the ones the alert rules name; each keeps
    the pods of a base Deployment by their name label, on the container port the pods'
    prometheus.io/port annotation names, and the agents get their `region` from the pod label
    leasehold/region (the alerts and dashboard group by it). (Debian's promtool is built without
    Kubernetes discovery and refuses `kubernetes_sd_configs`, so the file is checked by its shape.)"""
    path = DEPLOY / "prometheus" / "prometheus-k8s.yml"
    doc = yaml.safe_load(path.read_text())
    assert doc["rule_files"] == yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())["rule_files"]
    jobs = {j["job_name"]: j for j in doc["scrape_configs"]}
    alerts = (DEPLOY / "prometheus" / "alerts.yml").read_text()
    assert set(jobs) == set(re.findall(r'job="([^"]+)"', alerts))
    deployments = by_kind(kustomize(DEPLOY / "k8s"), "Deployment")
    for name, job in jobs.items():
        keep = {r["source_labels"][0]: r["regex"] for r in job["relabel_configs"] if r.get("action") == "keep"}
        (dep,) = [d for d in deployments.values()
                  if d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
                  == keep["__meta_kubernetes_pod_label_app_kubernetes_io_name"]]
        template = dep["spec"]["template"]
        (c,) = template["spec"]["containers"]
        scrape_port = int(template["metadata"]["annotations"]["prometheus.io/port"])
        (port,) = [p["name"] for p in c["ports"] if p["containerPort"] == scrape_port]
        assert keep["__meta_kubernetes_pod_container_port_name"] == port, name
        targets = {r["target_label"]: r["source_labels"] for r in job["relabel_configs"] if "target_label" in r}
        if name == "leasehold-agent":
            assert targets["region"] == ["__meta_kubernetes_pod_label_leasehold_region"]
            assert "leasehold/region" in template["metadata"]["labels"]


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels and matchExpressions In/NotIn/Exists/DoesNotExist) on ``labels``."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        has, value = e["key"] in labels, labels.get(e["key"])
        if not {"In": has and value in e.get("values", []), "NotIn": not has or value not in e.get("values", []),
                "Exists": has, "DoesNotExist": not has}[e["operator"]]:
            return False
    return True


@dataclass(frozen=True)
class PodRef:
    labels: dict[str, str]
    namespace: str = "leasehold"
    ports: tuple[tuple[str, int], ...] = ()  # (name, number) of its containers' TCP ports


def reachable(policies: list[dict], source: PodRef, target: PodRef, port: int) -> bool:
    """NetworkPolicy semantics for TCP ``port`` of ``target`` from ``source`` (both pods; the
    namespaces labelled only kubernetes.io/metadata.name): open unless a policy selecting the
    target isolates its ingress, then open only when one of those policies' rules admits it — and
    the source's egress likewise."""
    ns_labels = {"kubernetes.io/metadata.name": source.namespace}

    def port_matches(rule_ports: list[dict], pod: PodRef, number: int) -> bool:
        if not rule_ports:
            return True
        names = {name for name, n in pod.ports if n == number}
        return any(p.get("protocol", "TCP") == "TCP" and (p.get("port") is None or p["port"] == number
                   or p["port"] in names or (p.get("endPort") and p["port"] <= number <= p["endPort"]))
                   for p in rule_ports)

    def peer_matches(peer: dict, pod: PodRef, policy_ns: str, pod_ns_labels: dict[str, str]) -> bool:
        if "ipBlock" in peer:
            return False  # pod IPs are never named by these manifests' ipBlocks
        if "namespaceSelector" in peer:
            if not _selects(peer["namespaceSelector"], pod_ns_labels):
                return False
        elif pod.namespace != policy_ns:
            return False
        return _selects(peer.get("podSelector", {}), pod.labels)

    def admitted(direction: str, subject: PodRef, other: PodRef, other_ns_labels: dict[str, str]) -> bool:
        key, peers = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
        selecting = [p for p in policies if p["metadata"].get("namespace", "leasehold") == subject.namespace
                     and _selects(p["spec"]["podSelector"], subject.labels)
                     and direction in p["spec"].get("policyTypes", ["Ingress"])]
        if not selecting:
            return True
        ported = target  # the port is always the target's
        return any(port_matches(rule.get("ports", []), ported, port)
                   and (not rule.get(peers) or any(peer_matches(peer, other, subject.namespace, other_ns_labels)
                                                   for peer in rule[peers]))
                   for p in selecting for rule in p["spec"].get(key, []))

    return (admitted("Ingress", target, source, ns_labels)
            and admitted("Egress", source, target, {"kubernetes.io/metadata.name": target.namespace}))


def _pod_refs(docs: list[dict]) -> dict[str, PodRef]:
    refs = {}
    for kind in ("Deployment", "StatefulSet", "Job"):
        for name, d in by_kind(docs, kind).items():
            t = d["spec"]["template"]
            ports = tuple((p.get("name", ""), p["containerPort"]) for c in t["spec"]["containers"]
                          for p in c.get("ports", []))
            refs[name] = PodRef(t.get("metadata", {}).get("labels", {}), d["metadata"].get("namespace", "leasehold"), ports)
    return refs


def test_the_dev_overlay_lets_only_the_documented_pods_talk(dev_overlay: list[dict]):
    """What may talk to what (docs/deployment.md): the region's Redis only from its agents; etcd's
    client port only from the agents (policy reads), the allocators and the roles Job, its peer port
    only from its members; the allocator only from agents and labelled scrapers; the agents' HTTP
    port only from labelled gateways and scrapers, their RLS port only from labelled gateways
    (decision 0094). Any pod that isolates its egress still reaches the cluster DNS. Checked on the
    rendered overlay with NetworkPolicy's semantics, for every pair of its pods and a stranger in
    the namespace, one in another namespace, a labelled Prometheus and a labelled gateway."""
    policies = list(by_kind(dev_overlay, "NetworkPolicy").values())
    pods = _pod_refs(dev_overlay)
    strangers = {"stranger": PodRef({"app.kubernetes.io/name": "some-app"}),
                 "other-namespace": PodRef({"app.kubernetes.io/name": "some-app"}, namespace="apps"),
                 "prometheus": PodRef({"app.kubernetes.io/name": "prometheus", "leasehold/scrape": "true"},
                                      namespace="monitoring"),
                 "gateway": PodRef({"app.kubernetes.io/name": "envoy", "leasehold/gateway": "true"}, namespace="edge")}
    want = {("redis-eu", 6379): {"agent-eu"},
            ("etcd", 2379): {"agent-eu", "allocator", "leasehold-etcd-roles"},
            ("etcd", 2380): {"etcd"},
            ("allocator", 8080): {"agent-eu", "prometheus"},
            ("agent-eu", 8080): {"gateway", "prometheus"},
            ("agent-eu", 8089): {"gateway"}}
    got = {}
    for (target, port) in want:
        got[(target, port)] = {name for name, src in {**pods, **strangers}.items()
                               if reachable(policies, src, pods[target], port)}
    assert got == want
    dns = PodRef({"k8s-app": "kube-dns"}, namespace="kube-system", ports=(("dns-tcp", 53),))
    for name, pod in pods.items():
        assert reachable(policies, pod, dns, 53), f"{name} cannot resolve names"
    # the check can fail: with no policy every pod reaches Redis, etcd and the agents
    assert reachable([], strangers["stranger"], pods["redis-eu"], 6379)
    assert reachable([], strangers["stranger"], pods["agent-eu"], 8089)


def test_the_allocator_replicas_never_share_a_node_that_another_node_could_take():
    """One leader and its stand-in: on one node, that node's loss (or a drain that evicts both in
    turn before either is back) takes every allocator, and every region falls back at once. The
    hostname spread of the allocator is a hard constraint (a one-node dev cluster still schedules
    both: its single node is the whole topology); zones stay best effort."""
    (alloc,) = [d for d in kustomize(DEPLOY / "k8s") if d["kind"] == "Deployment" and d["metadata"]["name"] == "allocator"]
    spec = alloc["spec"]["template"]["spec"]
    by_key = {t["topologyKey"]: t for t in spec["topologySpreadConstraints"]}
    host = by_key["kubernetes.io/hostname"]
    assert host["whenUnsatisfiable"] == "DoNotSchedule" and host["maxSkew"] == 1
    assert host["labelSelector"]["matchLabels"] == alloc["spec"]["selector"]["matchLabels"]
    assert by_key["topology.kubernetes.io/zone"]["whenUnsatisfiable"] == "ScheduleAnyway"


COREDNS_TTL_S = 5  # CoreDNS's kubernetes plugin answers a headless Service's records with TTL 5 s (its default)
ENDPOINT_PROPAGATION_S = 2  # a terminating pod leaving its EndpointSlice, seen by CoreDNS (margin)


def _seconds(duration: str) -> float:
    return float(duration.rstrip("s"))


def test_the_agents_prestop_pause_outlasts_the_gateways_view_of_its_address():
    """Envoy reaches the agents through the headless Service agent-eu-rls (STRICT_DNS in every
    shipped Envoy file): a terminating agent's address stays in Envoy's host set until CoreDNS's
    answer expires and Envoy resolves again (``dns_refresh_rate``, 5 s by default). Until then its
    calls go to the agent; one that has stopped accepting makes them fail, and the shipped files
    then let the request through unlimited (RLS ``failure_mode_deny: false``) or refuse a closed
    route. So the preStop pause covers TTL + refresh + propagation, and the pause plus the drain
    (``--shutdown-report-ms``, 3 s, and a margin) fit the grace period."""
    from leasehold.local.gateways import PLACEHOLDER

    (agent,) = [d for d in kustomize(DEPLOY / "k8s") if d["kind"] == "Deployment" and d["metadata"]["name"] == "agent-eu"]
    spec = agent["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pause = float(command[1])
    for path in sorted((DEPLOY / "gateways").glob("envoy-*.yaml")):
        doc = yaml.safe_load(PLACEHOLDER.sub(lambda m: "10" if m[1].endswith("PORT") else m[1], path.read_text()))
        for cluster in doc["static_resources"]["clusters"]:
            addresses = [e["endpoint"]["address"]["socket_address"]["address"] for group in
                         cluster["load_assignment"]["endpoints"] for e in group["lb_endpoints"]]
            if "AGENT_HOST" not in addresses:
                continue
            assert cluster["type"] == "STRICT_DNS", (path.name, cluster["name"])
            refresh = _seconds(cluster.get("dns_refresh_rate", "5s"))
            need = COREDNS_TTL_S + refresh + ENDPOINT_PROPAGATION_S
            assert pause >= need, (f"{path.name} {cluster['name']}: the agent stops {pause} s after leaving its "
                                   f"Service; Envoy may still send to it for {need} s")
    drain = 3 + 5  # --shutdown-report-ms (3 s) and a margin (measured: tests/e2e/test_deploy_run.py)
    assert pause + drain <= spec["terminationGracePeriodSeconds"]


def test_the_roles_job_is_run_again_by_the_apply_that_changes_it(tmp_path: Path):
    """A Job's pod template cannot change. The roles Job's template names the ConfigMap of the
    roles script and (dev overlay) the Secrets by their content hash, so an upgrade whose script
    grants something new renders a different template: were the finished Job kept, that apply would
    be refused for it ("field is immutable") and the new grant would never reach etcd. The finished
    Job is deleted after a while (``ttlSecondsAfterFinished``), so the next apply creates and runs it
    again (re-running is safe: test_deploy_files.py)."""
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy, ignore=shutil.ignore_patterns("secrets"))
    before = by_kind(kustomize(copy / "k8s"), "Job")["leasehold-etcd-roles"]
    script = copy / "k8s" / "etcd" / "leasehold-roles.sh"
    script.write_text(script.read_text() + "# a grant added by an upgrade\n")
    after = by_kind(kustomize(copy / "k8s"), "Job")["leasehold-etcd-roles"]
    assert before["spec"]["template"] != after["spec"]["template"]  # what an apply would have to change
    ttl = after["spec"].get("ttlSecondsAfterFinished")
    assert ttl is not None and 0 < ttl <= 3600, "a finished roles Job must not stay: the next apply could not replace it"


def test_each_agent_pod_is_named_so_a_canary_slice_can_name_it():
    """``leasehold policy canary --agents NAME`` selects the agents whose --agent-id is NAME
    (docs/policy.md); unnamed, no agent of the base could be put in a canary slice. Each pod takes
    its own pod name, which matches the setting's pattern (tests/e2e/test_deploy_run.py starts one)."""
    (agent,) = [d for d in kustomize(DEPLOY / "k8s") if d["kind"] == "Deployment" and d["metadata"]["name"] == "agent-eu"]
    (c,) = agent["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert "--agent-id" not in c["args"]
    assert env["LEASEHOLD_AGENT_AGENT_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_every_service_port_reaches_a_named_port_of_the_pods_it_selects(dev_overlay: list[dict]):
    """Each Service selects pods of the overlay, and each of its ports' targetPort (a name, or the
    port's number) is a container port of every pod it selects; probes name ports that exist."""
    pods = _pod_refs(dev_overlay)
    for name, svc in by_kind(dev_overlay, "Service").items():
        selected = [p for p in pods.values() if _selects({"matchLabels": svc["spec"]["selector"]}, p.labels)]
        assert selected, f"Service {name} selects no pod"
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for pod in selected:
                assert any(target in (n, number) for n, number in pod.ports), (name, port)
    for kind in ("Deployment", "StatefulSet"):
        for name, d in by_kind(dev_overlay, kind).items():
            for c in d["spec"]["template"]["spec"]["containers"]:
                names = {p.get("name") for p in c.get("ports", [])} | {p["containerPort"] for p in c.get("ports", [])}
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    how = c.get(probe, {})
                    port = (how.get("httpGet") or how.get("tcpSocket") or {}).get("port")
                    assert port is None or port in names, (name, probe, port)
