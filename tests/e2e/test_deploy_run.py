"""deploy/k8s run as shipped: the dev overlay rendered by ``kubectl kustomize`` with the Secrets of
``leasehold secrets generate``, and each of its Leasehold containers started as the kubelet would
start it — its exact command, args and env (``$(VAR)`` expanded, ``fieldRef`` filled), every
volume materialised at its mount path with the kubelet's owner and modes (``defaultMode``, items,
``fsGroup``), as the pod's ``runAsUser``/``runAsGroup`` (and ``fsGroup`` as a supplementary group),
in the image's working directory ``/`` (not writable: the root file system is read-only, the
image's user owns nothing there) — against a real etcd (authentication on by the roles Job, run
the same way) and a real Redis (the generated ACL file). Only what a cluster provides is mapped:
service DNS names to the local servers' addresses, container ports to free ports, mount paths to
the materialised directories.

Then the probes are asked exactly as rendered (path and named port): the services become ready
within their startup probe's budget; readiness stays ready with Redis and the allocator gone
(the degradation design) while the store health says so; a privileged bypass is audited where
the container's log is; SIGTERM after the preStop pause drains within terminationGracePeriodSeconds.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from leasehold.commands.secrets import generate
from leasehold.local.procs import EtcdCluster, Proc, TlsFiles, free_port
from tests.support.manifests import DEPLOY, bind_mount, by_kind, kustomize

ROOT = Path(__file__).resolve().parents[2]
POD_IP = "127.0.0.1"
IMAGE_WORKDIR = "/"  # deploy/Dockerfile's runtime stage sets no WORKDIR
IMAGE_ENV = {"PYTHONUNBUFFERED": "1", "LEASEHOLD_BUILD_COMMIT": "unknown"}  # its ENV line


# Services of the namespace: the dev overlay's own (agent-eu, agent-eu-rls, allocator, etcd,
# redis-eu) and ones an operator may well add, named after the pods' app.kubernetes.io/name (a
# gateway-facing or monitoring Service). With service links on, the kubelet gives every pod of the namespace
# LEASEHOLD_AGENT_PORT=tcp://..., LEASEHOLD_ALLOCATOR_PORT=..., inside the services' own settings.
NAMESPACE_SERVICES = ("agent-eu", "agent-eu-rls", "allocator", "etcd", "redis-eu", "leasehold-agent",
                      "leasehold-agent-rls", "leasehold-allocator")


def _expand(value: str, env: dict[str, str]) -> str:
    """The kubelet's ``$(VAR)`` expansion (``$$`` escapes; an unknown name stays as written)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), value)


@dataclass
class Pod:
    """One rendered pod template, materialised on this host."""

    name: str
    spec: dict
    root: Path
    peers: dict[str, str]  # "service-dns:port" -> "127.0.0.1:port" of the local server
    ports: dict[int, int] = field(default_factory=dict)  # containerPort -> the free port used here
    pod_name: str = ""  # metadata.name (a Deployment's pods get a generated suffix)
    pod_ip: str = POD_IP  # status.podIP (the servers here all listen on POD_IP)
    mounts: dict[str, Path] = field(default_factory=dict)  # mountPath -> materialised directory

    @property
    def container(self) -> dict:
        (c,) = self.spec["containers"]
        return c

    def port(self, name_or_number: str | int) -> int:
        """A probe's or a Service's port (a name of the container, or a number) as served here."""
        for p in self.container.get("ports", []):
            if name_or_number in (p.get("name"), p["containerPort"]):
                return self.ports[p["containerPort"]]
        raise AssertionError(f"{self.name}: no container port {name_or_number!r}")

    def rewrite(self, value: str) -> str:
        if value.startswith("--") and "=" in value:  # --flag=value
            flag, _, rest = value.partition("=")
            return f"{flag}={self.rewrite(rest)}"
        for path in sorted(self.mounts, key=len, reverse=True):
            if value == path or value.startswith(path + "/"):
                value = str(self.mounts[path]) + value[len(path):]
                break
        for dns, addr in self.peers.items():
            value = value.replace(dns, addr)
        for container_port, here in self.ports.items():
            if value == str(container_port):
                return str(here)
            value = value.replace(f"{POD_IP}:{container_port}", f"{POD_IP}:{here}")
            value = value.replace(f"0.0.0.0:{container_port}", f"0.0.0.0:{here}")
        return value

    def materialise(self, docs: list[dict]) -> None:
        """Each volume as the kubelet writes it: files owned by root, mode ``items[].mode`` or
        ``defaultMode`` (0644), with an ``fsGroup`` group-owned by it and group-readable."""
        fs_group = self.spec.get("securityContext", {}).get("fsGroup")
        volumes = {v["name"]: v for v in self.spec.get("volumes", [])}
        configmaps, secrets = by_kind(docs, "ConfigMap"), by_kind(docs, "Secret")
        for m in self.container.get("volumeMounts", []):
            target = self.root / m["name"]
            target.mkdir(parents=True)
            self.mounts[m["mountPath"]] = target
            if m["name"] not in volumes:  # a StatefulSet's claim: a writable volume the kubelet gives to fsGroup
                os.chown(target, 0, fs_group if fs_group is not None else 0)
                target.chmod(0o2775)
                continue
            vol = volumes[m["name"]]
            if "emptyDir" in vol:
                os.chown(target, 0, fs_group if fs_group is not None else 0)
                target.chmod(0o2777 if fs_group is not None else 0o777)
                continue
            if "secret" in vol:
                src, ref = secrets[vol["secret"]["secretName"]], vol["secret"]
                data = {k: base64.b64decode(v) for k, v in src.get("data", {}).items()}
            else:
                src, ref = configmaps[vol["configMap"]["name"]], vol["configMap"]
                data = {k: v.encode() for k, v in src.get("data", {}).items()}
            default = ref.get("defaultMode", 0o644)
            items = ref.get("items") or [{"key": k, "path": k} for k in data]
            for item in items:
                path = target / item["path"]
                path.write_bytes(data[item["key"]])
                mode = item.get("mode", default)
                if fs_group is not None:
                    os.chown(path, 0, fs_group)
                    mode |= 0o440
                path.chmod(mode)
            os.chown(target, 0, fs_group if fs_group is not None else 0)
            target.chmod(0o755 if fs_group is None else 0o2755)

    def command(self, entrypoint: list[str] | None = None) -> tuple[list[str], dict[str, str]]:
        c = self.container
        env: dict[str, str] = {}
        if self.spec.get("enableServiceLinks", True):  # the kubelet's docker-link variables
            for service in NAMESPACE_SERVICES:
                name = service.upper().replace("-", "_")
                env |= {f"{name}_SERVICE_HOST": "10.96.0.10", f"{name}_SERVICE_PORT": "8080",
                        f"{name}_PORT": "tcp://10.96.0.10:8080", f"{name}_PORT_8080_TCP": "tcp://10.96.0.10:8080",
                        f"{name}_PORT_8080_TCP_PROTO": "tcp", f"{name}_PORT_8080_TCP_PORT": "8080",
                        f"{name}_PORT_8080_TCP_ADDR": "10.96.0.10"}
        for e in c.get("env", []):
            if "value" in e:
                env[e["name"]] = _expand(e["value"], env)
            else:
                ref = e["valueFrom"]["fieldRef"]["fieldPath"]
                env[e["name"]] = {"metadata.name": self.pod_name or f"{self.name}-7c9d5-x2k4p", "status.podIP": self.pod_ip}[ref]
        argv = [_expand(a, env) for a in (c.get("command") or entrypoint or []) + c.get("args", [])]
        env = {k: self.rewrite(v) for k, v in env.items()}
        argv = [self.rewrite(a) for a in argv]
        if argv[:2] == ["python", "-m"]:  # the image's python is this one: its path is the host's, never
            argv[0] = sys.executable      # rewritten (a checkout under /tmp is not the pod's /tmp emptyDir)
        return argv, env

    def start(self, docs: list[dict], workdir: Path, entrypoint: list[str] | None = None,
              implied: list[str] = ()) -> Proc:
        """``implied``: arguments the image's defaults stand for (a port it listens on unasked),
        given here so that the pod's port maps to the free one."""
        self.materialise(docs)
        for p in self.container.get("ports", []):
            self.ports.setdefault(p["containerPort"], free_port())
        argv, env = self.command(entrypoint)
        argv += [self.rewrite(a) for a in implied]
        sc = {**self.spec.get("securityContext", {}), **self.container.get("securityContext", {})}
        assert sc.get("runAsNonRoot") is True and sc.get("runAsUser"), f"{self.name} runs as a named non-root user"
        groups = [str(sc["fsGroup"])] if "fsGroup" in sc else []
        ident = ["setpriv", "--reuid", str(sc["runAsUser"]), "--regid", str(sc.get("runAsGroup", 0)),
                 *(["--groups", ",".join(groups)] if groups else ["--clear-groups"]), "--"]
        base = {"PATH": "/usr/local/bin:/usr/bin:/bin", "PYTHONPATH": str(ROOT), **IMAGE_ENV}
        if self.container.get("volumeMounts") and any(m["mountPath"] == "/tmp" for m in self.container["volumeMounts"]):
            base["TMPDIR"] = str(self.mounts["/tmp"])  # (the emptyDir is the pod's /tmp)
        script = _container_fs(self.root, readonly_root=bool(sc.get("readOnlyRootFilesystem")),
                               empty_dirs=[self.mounts[m["mountPath"]] for m in self.container.get("volumeMounts", [])
                                           if "emptyDir" in {v["name"]: v for v in self.spec.get("volumes", [])}
                                           .get(m["name"], {})],
                               claims=[self.mounts[m["mountPath"]] for m in self.container.get("volumeMounts", [])
                                       if m["name"] not in {v["name"] for v in self.spec.get("volumes", [])}])
        return Proc(self.name, ["unshare", "--mount", "--propagation", "private", "sh", "-euc", script, "sh",
                                *ident, *argv], workdir / self.name, env={**base, **env}, cwd=IMAGE_WORKDIR).start()

    def probe(self, kind: str) -> int:
        get = self.container[kind]["httpGet"]
        try:
            return httpx.get(f"http://{POD_IP}:{self.port(get['port'])}{get['path']}",
                             timeout=self.container[kind].get("timeoutSeconds", 1)).status_code
        except httpx.HTTPError:
            return 0


def _exit_status(proc: Proc, timeout: float) -> int:
    """The process's exit status, waiting up to ``timeout`` seconds for it to end."""
    assert proc.popen is not None, f"{proc.name} was never started"
    return proc.popen.wait(timeout)


def _container_fs(scratch: Path, *, readonly_root: bool, empty_dirs: list[Path], claims: list[Path] = ()) -> str:
    """A shell script, run as root in a private mount namespace before the container's user takes
    over: the root file system read-only when the container asks for it, each emptyDir a fresh
    tmpfs, and this interpreter reachable by that user (it may live under a directory only root
    may enter, e.g. root's pyenv: that directory is replaced by an empty tmpfs holding only it)."""
    lines = []
    prefix = Path(sys.base_prefix).resolve()
    closed = [a for a in reversed(prefix.parents) if a != Path("/") and not os.stat(a).st_mode & 0o001]
    if closed:
        stage = tempfile.mkdtemp(prefix="python-", dir=scratch)
        lines += [f"mount --bind {prefix} {stage}", f"mount -t tmpfs -o mode=755 tmpfs {closed[0]}",
                  f"mkdir -p {prefix}", f"mount --move {stage} {prefix}"]
    if readonly_root:
        lines += ["mount --bind / /", "mount -o remount,bind,ro /"]
    lines += [f"mount -t tmpfs -o mode=1777 tmpfs {d}" for d in empty_dirs]
    for d in claims:  # a persistent volume: its own mount, writable
        lines += [f"mount --bind {d} {d}", f"mount -o remount,bind,rw {d}"]
    return "\n".join([*lines, 'exec "$@"'])


def _wait_probe(pod: Pod, proc: Proc, kind: str, want: int = 200, budget: float | None = None) -> float:
    """Ask the probe at its period until it answers ``want``; seconds taken, within its budget."""
    probe = pod.container[kind]
    if budget is None:
        budget = probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3) + probe.get("initialDelaySeconds", 0)
    start = time.monotonic()
    while time.monotonic() - start < budget:
        if pod.probe(kind) == want:
            return time.monotonic() - start
        assert proc.alive(), f"{pod.name} exited:\n{proc.tail()}"
        time.sleep(0.25)
    raise AssertionError(f"{pod.name}: {kind} not {want} within its {budget} s:\n{proc.tail()}")


def _needs_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("running the manifests as the kubelet would needs root (mount namespaces, files owned by "
                    "root and the pods' groups, setpriv to the pods' users): run `make test` as root")


@pytest.fixture(scope="module")
def overlay(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    """The dev overlay rendered with freshly generated Secrets, and the directory of those files."""
    _needs_root()
    copy = tmp_path_factory.mktemp("deploy") / "deploy"
    shutil.copytree(DEPLOY, copy, ignore=shutil.ignore_patterns("secrets"))
    generate(copy / "k8s-dev" / "secrets")
    return kustomize(copy / "k8s-dev"), copy / "k8s-dev" / "secrets"


@pytest.fixture(scope="module")
def running(overlay: tuple[list[dict], Path]):
    """The dev overlay's etcd roles Job, Redis, allocator and agent, run as rendered."""
    rendered, secrets = overlay
    # the pods' files must be reachable by their users: pytest's base directory is root's alone
    work = Path(tempfile.mkdtemp(prefix="leasehold-pods-"))
    work.chmod(0o755)
    pods = {name: d["spec"]["template"]["spec"] for kind in ("Deployment", "Job", "StatefulSet")
            for name, d in by_kind(rendered, kind).items()}
    started: list[Proc] = []
    try:
        # the dev overlay's 3-member etcd, each member as its StatefulSet pod etcd-<i>
        (etcd_set,) = by_kind(rendered, "StatefulSet").values()
        members = [Pod("etcd", pods["etcd"], work / f"etcd-{i}", {}, pod_name=f"etcd-{i}")
                   for i in range(etcd_set["spec"]["replicas"])]
        peers: dict[str, str] = {}
        for i, m in enumerate(members):
            m.ports = {2379: free_port(), 2380: free_port()}
            peers |= {f"etcd-{i}.etcd:{n}": f"{POD_IP}:{here}" for n, here in m.ports.items()}
        for i, m in enumerate(members):
            m.peers = peers
            started.append(m.start(rendered, work / f"etcd-{i}", entrypoint=[]))
        for m, proc in zip(members, started, strict=True):
            _wait_probe(m, proc, "readinessProbe", budget=60)  # (no startup probe: quorum first)
        # the roles Job: users, roles, authentication on
        job = Pod("leasehold-etcd-roles", pods["leasehold-etcd-roles"], work / "job", peers)
        proc = job.start(rendered, work)
        assert _exit_status(proc, 60) == 0, proc.tail()
        # Redis as the dev overlay runs it (the image's entrypoint is redis-server)
        redis = Pod("redis-eu", pods["redis-eu"], work / "redis", peers)
        started.append(redis.start(rendered, work, entrypoint=[shutil.which("redis-server") or "redis-server"],
                                   implied=["--port", "6379", "--bind", POD_IP]))
        redis_proc = started[-1]
        # (the image listens on 6379 of its own pod; here the pod's port is a free one)
        peers["redis-eu:6379"] = f"{POD_IP}:{redis.ports[6379]}"
        alloc = Pod("allocator", pods["allocator"], work / "allocator", peers)
        started.append(alloc.start(rendered, work))
        alloc_proc = started[-1]
        peers["allocator:8080"] = f"{POD_IP}:{alloc.ports[8080]}"
        agent = Pod("agent-eu", pods["agent-eu"], work / "agent", peers)
        _wait_probe(alloc, alloc_proc, "startupProbe")
        started.append(agent.start(rendered, work))
        yield {"agent": (agent, started[-1]), "allocator": (alloc, alloc_proc), "redis": (redis, redis_proc),
               "etcd": list(zip(members, started[:len(members)], strict=True)),
               "gateway": {"Authorization": "Bearer " + (secrets / "gateway.token").read_text().strip()},
               "secrets": secrets, "work": work}
    finally:
        for p in reversed(started):
            p.stop()
        if not os.environ.get("KEEP_PODS"):
            shutil.rmtree(work, ignore_errors=True)


def _bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    return int(quantity[:-2]) * units[quantity[-2:]] if quantity[-2:] in units else int(quantity)


def test_the_services_start_as_rendered_and_become_ready_within_the_startup_probe(running):
    """Ready within the startup probe's budget, live; and, ready and idle, each uses less memory than
    it requests (the scheduler places pods by their requests: a process above its request from the
    start is what a node under memory pressure evicts first)."""
    for name in ("allocator", "agent"):
        pod, proc = running[name]
        _wait_probe(pod, proc, "startupProbe")
        _wait_probe(pod, proc, "readinessProbe")
        assert pod.probe("livenessProbe") == 200
        rss = int(re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{proc.pid}/status").read_text(), re.M)[1]) * 1024
        resources = pod.container["resources"]
        print(f"{name}: RSS {rss >> 20} MiB, requests {resources['requests']['memory']}, limit {resources['limits']['memory']}")
        assert rss < _bytes(resources["requests"]["memory"]), f"{name}: RSS {rss >> 20} MiB at idle"


def _etcdctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["etcdctl", "--dial-timeout=2s", "--command-timeout=3s", *args], capture_output=True,
                          text=True, timeout=30, env={"PATH": "/usr/local/bin:/usr/bin:/bin", "ETCDCTL_API": "3"})


def test_the_rendered_etcd_speaks_only_tls_and_the_clients_verify_it(running):
    """etcd as rendered (the dev overlay, the generated certificate) while the allocator and the agent
    run against it over TLS: a plaintext client is refused on the client port (passwords and leases
    never cross the network in clear); a client trusting another CA refuses the member (what a
    stand-in etcd on the path would present); the peer port answers only a peer with a certificate
    of etcd's CA; the CA the services mount verifies the member."""
    from leasehold.commands.secrets import etcd_pki

    secrets, work = running["secrets"], running["work"]
    member, _ = running["etcd"][0]
    client, peer = member.ports[2379], member.ports[2380]
    ca = str(secrets / "etcd-ca.crt")
    ok = _etcdctl(f"--endpoints=https://{POD_IP}:{client}", f"--cacert={ca}", "endpoint", "status")
    assert ok.returncode == 0, ok.stderr
    plain = _etcdctl(f"--endpoints=http://{POD_IP}:{client}", "endpoint", "status")
    assert plain.returncode != 0, "a plaintext client reached the rendered etcd"
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://{POD_IP}:{client}/version", timeout=3)
    rogue = work / "rogue-ca.crt"
    rogue.write_bytes(dict((n, b) for n, b, _ in etcd_pki())["etcd-ca.crt"])
    other = _etcdctl(f"--endpoints=https://{POD_IP}:{client}", f"--cacert={rogue}", "endpoint", "status")
    assert other.returncode != 0 and "certificate" in other.stderr, other.stderr
    # the peer port: TLS, and a certificate of etcd's CA required of the caller
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"https://{POD_IP}:{peer}/members", verify=ssl.create_default_context(cafile=ca), timeout=3)
    member_ctx = ssl.create_default_context(cafile=ca)
    member_ctx.load_cert_chain(secrets / "etcd-server.crt", secrets / "etcd-server.key")
    r = httpx.get(f"https://{POD_IP}:{peer}/members", timeout=3, verify=member_ctx)
    assert r.status_code == 200 and len(r.json()) == 3, r.text
    # and the services run against it: the allocator's store health, and a bundle published over TLS
    # (as the publisher, with the CA an operator's port-forward uses) reaches the allocator and the agent
    alloc, alloc_proc = running["allocator"]
    agent, agent_proc = running["agent"]
    _wait_probe(alloc, alloc_proc, "readinessProbe")
    assert httpx.get(f"http://{POD_IP}:{alloc.port('http')}/v1/health/store", timeout=10).status_code == 200
    from leasehold.commands.cli import main as cli_main

    urls = {"allocator": f"http://{POD_IP}:{alloc.port('http')}/metrics",
            "agent": f"http://{POD_IP}:{agent.port('http')}/metrics"}
    names = {"allocator": "leasehold_allocator_policy_reloads_total", "agent": "leasehold_agent_policy_reloads_total"}

    def accepted() -> dict[str, float]:
        return {k: sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(u, timeout=5).text.splitlines()
                       if line.startswith(names[k]) and 'outcome="accepted"' in line) for k, u in urls.items()}

    before = accepted()
    assert cli_main(["policy", "publish", str(ROOT / "policies" / "northstar-global.json"), "--as-version", "900",
                     "--etcd", f"https://{POD_IP}:{client}", "--etcd-ca-file", ca, "--etcd-user", "publisher",
                     "--etcd-password-file", str(secrets / "etcd-publisher.password")]) == 0
    deadline = time.monotonic() + 15
    while any(v <= before[k] for k, v in accepted().items()):
        assert time.monotonic() < deadline, f"the bundle published over TLS did not reach {accepted()} from {before}" \
                                            f"\n{alloc_proc.tail()}\n{agent_proc.tail()}"
        time.sleep(0.5)


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_a_privileged_bypass_is_audited_where_the_container_logs(running):
    """The sample bundle's operators' probe is an exempt rule: each allowed decision under it is an
    audit event. Run as shipped, the event must land somewhere (the container's stderr: the root
    file system is read-only and the working directory is not the user's), not be dropped as an
    audit write error."""
    agent, proc = running["agent"]
    _wait_probe(agent, proc, "readinessProbe")
    url = f"http://{POD_IP}:{agent.port('http')}"
    r = httpx.post(url + "/v1/admit", headers=running["gateway"], timeout=5,
                   json={"requestId": "deploy-run-bypass-1", "tenantId": "northstar-ops", "routeGroup": "probe",
                         "principal": {"type": "service", "id": "prober"}})
    assert r.status_code == 200 and r.json()["allowed"], r.text
    metrics = httpx.get(url + "/metrics", timeout=5).text
    assert _metric(metrics, "leasehold_agent_audit_write_errors_total") == 0, "the bypass audit event was lost"
    deadline = time.monotonic() + 5
    while '"requestId":"deploy-run-bypass-1"' not in proc.tail(200) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert '"requestId":"deploy-run-bypass-1"' in proc.tail(200)


def test_without_etcd_quorum_the_allocator_and_the_agent_stay_ready_and_alive(running):
    """etcd losing quorum (2 of the 3 members stopped) is the allocator's store outage: it answers
    retriable 503s and the agents spend their bounded allowances, so neither leaves its Service nor
    is restarted, for longer than either probe's failure budget; the allocator's store health says
    so. The members come back after."""
    agent, proc = running["agent"]
    alloc, alloc_proc = running["allocator"]
    members = running["etcd"]
    for pod, p in ((agent, proc), (alloc, alloc_proc)):
        _wait_probe(pod, p, "readinessProbe")
    for _, p in members[1:]:
        p.stop()
    try:
        budget = max(pod.container[k]["periodSeconds"] * pod.container[k]["failureThreshold"]
                     for pod in (agent, alloc) for k in ("readinessProbe", "livenessProbe")) + 2
        end = time.monotonic() + min(budget, 35)
        while time.monotonic() < end:
            for pod, p in ((agent, proc), (alloc, alloc_proc)):
                assert pod.probe("readinessProbe") == 200, f"{pod.name} unready without etcd:\n{p.tail()}"
                assert pod.probe("livenessProbe") == 200, f"{pod.name} not live without etcd:\n{p.tail()}"
            time.sleep(1)
        assert httpx.get(f"http://{POD_IP}:{alloc.port('http')}/v1/health/store", timeout=10).status_code == 503
    finally:
        for _, p in members[1:]:
            p.start()
    for pod, p in members:
        _wait_probe(pod, p, "readinessProbe", budget=60)


def _drain(pod: Pod, proc: Proc) -> float:
    """preStop as rendered, then SIGTERM, as the kubelet does: seconds until the process ended
    (from the start of preStop), asserting it turned unready and shut down cleanly in the grace period."""
    grace = pod.spec.get("terminationGracePeriodSeconds", 30)
    pre_stop = pod.container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"  # (the image has sleep: coreutils)
    start = time.monotonic()
    subprocess.run(pre_stop, check=True, timeout=grace)
    assert pod.probe("readinessProbe") == 200  # still serving through the pause
    os.kill(proc.pid, signal.SIGTERM)  # (unshare, sh and setpriv exec: the PID is the service's)
    saw_unready = False
    while proc.alive() and time.monotonic() - start < grace:
        saw_unready = saw_unready or pod.probe("readinessProbe") in (0, 503)
        time.sleep(0.05)
    took = time.monotonic() - start
    assert not proc.alive(), f"{pod.name} still running {grace} s after preStop began: the kubelet would SIGKILL it"
    # (uvicorn re-raises the SIGTERM it handled once it has shut down)
    assert _exit_status(proc, 1) in (0, -signal.SIGTERM), proc.tail()
    assert "Application shutdown complete" in proc.tail(), proc.tail()
    assert saw_unready, f"{pod.name} never answered unready while draining"
    print(f"{pod.name}: preStop {pre_stop[1]} s + drain: {took:.2f} s of {grace} s")
    assert took < grace - 5, f"{pod.name}: preStop + drain took {took:.1f} s of the {grace} s grace period"
    return took


def test_the_allocator_drains_within_its_grace_period(running):
    """The allocator, leader of every shard with agents holding leases, resigns and stops within
    what terminationGracePeriodSeconds leaves after preStop."""
    alloc, proc = running["allocator"]
    _wait_probe(alloc, proc, "readinessProbe")
    _drain(alloc, proc)


def test_readiness_stays_ready_without_redis_and_the_allocator_and_liveness_never_restarts(running):
    """The degradation design as the probes see it: with the region's Redis and the allocator gone
    the agent answers by each rule's fail mode, so readiness keeps it in its Service and liveness
    does not restart it, for longer than either probe's failure budget; the store health says the
    store is down. (Last but one in the module: it stops Redis and the allocator.)"""
    agent, proc = running["agent"]
    alloc, alloc_proc = running["allocator"]
    redis, redis_proc = running["redis"]
    _wait_probe(agent, proc, "readinessProbe")
    redis_proc.kill()
    alloc_proc.kill()
    url = f"http://{POD_IP}:{agent.port('http')}"
    budget = max(agent.container[k]["periodSeconds"] * agent.container[k]["failureThreshold"]
                 for k in ("readinessProbe", "livenessProbe")) + 2
    end = time.monotonic() + min(budget, 35)
    while time.monotonic() < end:
        assert agent.probe("readinessProbe") == 200, proc.tail()
        assert agent.probe("livenessProbe") == 200, proc.tail()
        time.sleep(1)
    assert httpx.get(url + "/v1/health/store", timeout=5).status_code == 503
    r = httpx.post(url + "/v1/admit", headers=running["gateway"], timeout=5,
                   json={"requestId": "deploy-run-degraded-1", "tenantId": "atlas", "routeGroup": "read",
                         "principal": {"type": "user", "id": "U-3"}})
    assert r.status_code == 200 and r.json()["fallback"] is True, r.text


def test_sigterm_after_the_prestop_pause_drains_within_the_grace_period(running):
    """The kubelet runs preStop, then sends SIGTERM, and kills what still runs when
    terminationGracePeriodSeconds (counted from the start of preStop) are over. The agent turns
    unready at SIGTERM and drains (closes and reports its leases, bounded by --shutdown-report-ms)
    well within what is left, even with its allocator and Redis unreachable (the slowest drain)."""
    agent, proc = running["agent"]
    _drain(agent, proc)


# ---------------------------------------------------------------------------------------------
# deploy/docker-compose.yml, as `docker-compose config` resolves it: each Leasehold service's
# command and environment run as the image runs them (uid 10001, working directory /), its secrets
# and bind mounts at their paths, its read_only root, tmpfs, cap_drop and no-new-privileges as
# written, against real etcd and Redis; every healthcheck asked as the
# engine would ask it, inside the service's network view.

IMAGE_USER = 10001  # deploy/Dockerfile's USER


@dataclass
class Service:
    name: str
    spec: dict
    secrets: dict[str, str]  # compose secret -> its file
    peers: dict[str, str]
    ports: dict[int, int] = field(default_factory=dict)

    def rewrite(self, value: str) -> str:
        for ref in self.spec.get("secrets", []):
            source = ref if isinstance(ref, str) else ref["source"]
            value = value.replace(f"/run/secrets/{source}", self.secrets[source])
        for source, target, _ in map(bind_mount, self.spec.get("volumes", [])):
            if value == target or value.startswith(target + "/"):
                value = source + value[len(target):]
        for dns, addr in self.peers.items():
            value = value.replace(dns, addr)
        for inside, here in self.ports.items():
            if value == str(inside):
                return str(here)
            value = value.replace(f"127.0.0.1:{inside}", f"127.0.0.1:{here}")
        return value

    def argv(self, words: list[str]) -> list[str]:
        words = [self.rewrite(w) for w in words]
        return [sys.executable, *words[1:]] if words[0] == "python" else words

    def lockdown(self) -> list[str]:
        """setpriv's words for what the engine applies of ``cap_drop: [ALL]`` (no capability, none
        in the bounding set) and ``security_opt: [no-new-privileges:true]``."""
        words = []
        if "ALL" in [c.upper() for c in self.spec.get("cap_drop") or []]:
            words += ["--bounding-set", "-all", "--inh-caps", "-all"]
        if {o.replace("=", ":") for o in self.spec.get("security_opt") or []} & {"no-new-privileges:true",
                                                                                  "no-new-privileges"}:
            words.append("--no-new-privs")
        return words

    def tmpfs(self, workdir: Path) -> dict[str, Path]:
        """Each ``tmpfs`` target of the service -> the directory a fresh tmpfs is mounted on here."""
        targets = self.spec.get("tmpfs") or []
        dirs = {}
        for i, target in enumerate([targets] if isinstance(targets, str) else targets):
            d = workdir / f"{self.name}-tmpfs{i}"
            d.mkdir(exist_ok=True)
            dirs[target.split(":")[0]] = d
        return dirs

    def start(self, workdir: Path, listens: dict[int, int], user: int | None = IMAGE_USER,
              implied: list[str] = ()) -> Proc:
        self.ports = listens
        env = {k: self.rewrite(str(v)) for k, v in (self.spec.get("environment") or {}).items()}
        ident = (["setpriv", "--reuid", str(user), "--regid", str(user), "--clear-groups", *self.lockdown(), "--"]
                 if user else [])
        tmpfs = self.tmpfs(workdir)
        script = _container_fs(workdir, readonly_root=bool(self.spec.get("read_only")), empty_dirs=list(tmpfs.values()))
        base = {"PATH": "/usr/local/bin:/usr/bin:/bin", "PYTHONPATH": str(ROOT), **IMAGE_ENV}
        if "/tmp" in tmpfs:
            base["TMPDIR"] = str(tmpfs["/tmp"])  # (the tmpfs is the container's /tmp)
        argv = self.argv(self.spec["command"]) + [self.rewrite(a) for a in implied]
        return Proc(self.name, ["unshare", "--mount", "--propagation", "private", "sh", "-euc", script, "sh",
                                *ident, *argv], workdir / self.name, env={**base, **env}, cwd=IMAGE_WORKDIR).start()

    def healthcheck(self, workdir: Path, user: int | None = IMAGE_USER) -> subprocess.CompletedProcess:
        test = self.spec["healthcheck"]["test"]
        if test[0] == "CMD-SHELL":  # (a port inside the shell line is a word of it)
            line = self.rewrite(test[1])
            for inside, here in self.ports.items():
                line = re.sub(rf"(?<![\d.:]){inside}\b", str(here), line)
            words = ["sh", "-c", line]
        else:
            assert test[0] == "CMD", test
            words = self.argv(test[1:])
        ident = ["setpriv", "--reuid", str(user), "--regid", str(user), "--clear-groups", "--"] if user else []
        script = _container_fs(workdir, readonly_root=False, empty_dirs=[])
        return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-euc", script, "sh",
                               *ident, *words], capture_output=True, text=True, timeout=30, cwd=IMAGE_WORKDIR,
                              env={"PATH": "/usr/local/bin:/usr/bin:/bin", "PYTHONPATH": str(ROOT)})


@pytest.fixture(scope="module")
def compose(tmp_path_factory: pytest.TempPathFactory):
    _needs_root()
    compose_bin = shutil.which("docker-compose")
    if compose_bin is None:
        pytest.fail("docker-compose is missing: `make test` installs it (Debian package docker-compose)")
    work = Path(tempfile.mkdtemp(prefix="leasehold-compose-"))
    work.chmod(0o755)
    copy = work / "deploy"
    shutil.copytree(DEPLOY, copy, ignore=shutil.ignore_patterns("secrets"))
    (work / "policies").mkdir()
    shutil.copy(ROOT / "policies" / "northstar-global.json", work / "policies")
    generate(copy / "secrets")
    (copy / "secrets").chmod(0o755)  # (the generator's 0700 keeps other users of the host out; here the
    # services' user stands in for the container's bind mounts)
    r = subprocess.run([compose_bin, "-f", str(copy / "docker-compose.yml"), "config"], capture_output=True,
                       text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(work)})
    assert r.returncode == 0, r.stderr
    import yaml

    resolved = yaml.safe_load(r.stdout)
    files = {name: spec["file"] for name, spec in resolved["secrets"].items()}
    started: list[Proc] = []
    # etcd as compose runs it: TLS with the generated certificate (its clients verify it by its CA)
    tls = TlsFiles(ca=copy / "secrets" / "etcd-ca.crt", cert=copy / "secrets" / "etcd-server.crt",
                   key=copy / "secrets" / "etcd-server.key")
    etcd = EtcdCluster(work / "etcd", members=3, tls=tls).start()
    try:
        peers = {f"etcd-{i}:2379": e for i, e in enumerate(etcd.endpoints)}
        svc = {name: Service(name, spec, files, peers) for name, spec in resolved["services"].items()}
        proc = svc["etcd-init"].start(work, {})
        assert _exit_status(proc, 60) == 0, proc.tail()
        running = {}
        for name in ("redis-eu", "allocator-1", "allocator-2", "agent-eu"):
            port = free_port()
            if name == "redis-eu":  # the redis image's own user; it listens on 6379 unasked
                running[name] = svc[name].start(work, {6379: port}, user=999, implied=["--port", "6379", "--bind",
                                                                                        "127.0.0.1"])
                peers["redis-eu:6379"] = f"127.0.0.1:{port}"
            else:
                running[name] = svc[name].start(work, {8080: port})
                peers[f"{name}:8080"] = f"127.0.0.1:{port}"
            started.append(running[name])
        yield svc, running, work, etcd
    finally:
        for p in reversed(started):
            p.stop()
        etcd.stop()
        if not os.environ.get("KEEP_PODS"):
            shutil.rmtree(work, ignore_errors=True)


def test_compose_services_start_as_written_and_their_healthchecks_are_real(compose):
    """etcd-init applies the roles (exit 0); Redis, both allocators and an agent start with their
    commands and environment as written and turn healthy by their own healthcheck within its
    start period; each service's healthcheck fails once its service is gone (it checks something);
    etcd's healthcheck passes against a member with authentication on."""
    svc, running, work, etcd = compose
    for name, proc in running.items():
        hc = svc[name].spec["healthcheck"]
        budget = _seconds(hc.get("start_period", "0s")) + _seconds(hc["interval"]) * hc["retries"]
        end = time.monotonic() + budget
        while True:
            r = svc[name].healthcheck(work, user=999 if name == "redis-eu" else IMAGE_USER)
            if r.returncode == 0:
                break
            assert proc.alive(), f"{name} exited:\n{proc.tail()}"
            assert time.monotonic() < end, f"{name} not healthy within {budget} s: {r.stderr[-300:]}\n{proc.tail()}"
            time.sleep(1)
    # each Leasehold service runs locked down as written: its root file system read-only, its /tmp a
    # tmpfs, no capability (none even in its bounding set), no privilege to gain (etcd-init, started
    # the same way, did its work so and exited 0)
    for name, proc in running.items():
        if name == "redis-eu":
            continue
        assert not _lockdown_gaps(proc.pid, work), (name, _lockdown_gaps(proc.pid, work))
    # etcd, as its image's healthcheck asks a member (its listen address here)
    member = Service("etcd-0", svc["etcd-0"].spec, svc["etcd-0"].secrets, {"127.0.0.1:2379": etcd.endpoints[0]})
    assert member.healthcheck(work, user=None).returncode == 0
    for name, proc in running.items():
        proc.stop()
        r = svc[name].healthcheck(work, user=999 if name == "redis-eu" else IMAGE_USER)
        assert r.returncode != 0, f"{name}: its healthcheck passes with the service gone"
    etcd.stop_member(0)
    assert member.healthcheck(work, user=None).returncode != 0, "etcd's healthcheck passes with the member gone"


def _seconds(duration: str) -> float:
    return float(duration[:-1]) * {"s": 1, "m": 60}[duration[-1]]


def _lockdown_gaps(pid: int, work: Path) -> list[str]:
    """What the process of ``pid`` lacks of a locked-down container, from its /proc files as the
    kernel has them: its root read-only, its TMPDIR a tmpfs under ``work``, no capability in any set,
    no privilege to gain. Empty: none."""
    gaps = []
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    if status["NoNewPrivs"].strip() != "1":
        gaps.append("NoNewPrivs " + status["NoNewPrivs"].strip())
    gaps += [f"{k} {status[k].strip()}" for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")
             if int(status[k], 16)]
    mounts: dict[str, tuple[str, str]] = {}  # mount point -> (options, file system type)
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields, _, rest = line.partition(" - ")
        words = fields.split()
        mounts[words[4]] = (words[5], rest.split()[0])
    if not os.statvfs(f"/proc/{pid}/root").f_flag & os.ST_RDONLY:  # the mount its root directory is on
        gaps.append("/ is writable")
    env = dict(e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in e)
    tmp = env.get("TMPDIR", "")
    if not (tmp.startswith(str(work) + "/") and mounts.get(tmp, ("", ""))[1] == "tmpfs"):
        gaps.append(f"TMPDIR {tmp!r} is not a tmpfs of its own")
    return gaps


def test_credentials_are_mounted_readable_by_the_pods_user_only(overlay, tmp_path: Path):
    """Every Secret volume of the overlay, written as the kubelet writes it (``defaultMode``/item
    modes, group-owned by ``fsGroup``), is readable by the pod's user through its group and by no
    other user of the container (no world bits); the services read them so in ``running``."""
    rendered, _ = overlay
    for kind in ("Deployment", "Job", "StatefulSet"):
        for name, d in by_kind(rendered, kind).items():
            spec = d["spec"]["template"]["spec"]
            if not any("secret" in v for v in spec.get("volumes", [])):
                continue
            pod = Pod(name, spec, tmp_path / name, {})
            pod.materialise(rendered)
            sc = spec["securityContext"]
            secret_mounts = {m["mountPath"] for c in spec["containers"] for m in c.get("volumeMounts", [])
                             if "secret" in {v["name"]: v for v in spec["volumes"]}.get(m["name"], {})}  # (a claim: not in volumes)
            for mount in secret_mounts:
                for f in pod.mounts[mount].iterdir():
                    st = f.stat()
                    assert st.st_mode & 0o007 == 0, f"{name}: {mount}/{f.name} is mode {st.st_mode & 0o777:o}"
                    assert st.st_gid == sc.get("fsGroup") == sc["runAsGroup"] and st.st_mode & 0o040, \
                        f"{name}: {mount}/{f.name} not readable by the pod's group"


def test_an_agent_starting_with_every_dependency_unreachable_starts_and_turns_ready_in_the_budget(overlay):
    """The slow start the startup probe covers: Redis, the allocator and etcd all unreachable
    (closed ports) when an agent pod starts. Its bounded waits (the first etcd read, Redis INFO, the
    lease warm-up within --allocator-deadline-ms) end within the startup probe's budget, so the
    liveness probe never restarts it mid-start; then it is ready — it can answer, by the rules'
    fail modes — rather than held out of its Service until its stores come back."""
    rendered, _ = overlay
    work = Path(tempfile.mkdtemp(prefix="leasehold-pods-"))
    work.chmod(0o755)
    spec = by_kind(rendered, "Deployment")["agent-eu"]["spec"]["template"]["spec"]
    closed = {dns: f"{POD_IP}:{free_port()}" for dns in
              ("redis-eu:6379", "allocator:8080", "etcd-0.etcd:2379", "etcd-1.etcd:2379", "etcd-2.etcd:2379")}
    agent = Pod("agent-eu", spec, work / "agent", closed)
    proc = agent.start(rendered, work)
    try:
        started = _wait_probe(agent, proc, "startupProbe")
        ready = _wait_probe(agent, proc, "readinessProbe", budget=agent.container["startupProbe"]["periodSeconds"]
                            * agent.container["startupProbe"]["failureThreshold"])
        print(f"agent with nothing reachable: live after {started:.1f} s, ready {ready:.1f} s later")
        assert agent.probe("livenessProbe") == 200
    finally:
        proc.stop()
        shutil.rmtree(work, ignore_errors=True)


def test_on_an_ipv6_cluster_the_allocator_refuses_an_address_no_agent_could_follow(overlay):
    """``LEASEHOLD_ALLOCATOR_ADVERTISE_URL: http://$(POD_IP):8080`` on an IPv6 single-stack cluster is
    ``http://fd00::1:8080``: the URL a not-leader answer names, which no agent can parse (it used to
    start and hand it out). It is refused at start, naming the fix (allocator.yaml says what to set)."""
    rendered, _ = overlay
    work = Path(tempfile.mkdtemp(prefix="leasehold-pods-"))
    work.chmod(0o755)
    spec = by_kind(rendered, "Deployment")["allocator"]["spec"]["template"]["spec"]
    closed = {f"etcd-{i}.etcd:2379": f"{POD_IP}:{free_port()}" for i in range(3)}
    alloc = Pod("allocator", spec, work / "allocator", closed, pod_ip="fd00:10:244::7")
    proc = alloc.start(rendered, work)
    try:
        assert _exit_status(proc, 30) != 0, proc.tail()
        assert "an IPv6 address in a URL goes in brackets" in proc.tail() and "Traceback" not in proc.tail()
    finally:
        proc.stop()
        shutil.rmtree(work, ignore_errors=True)


def test_an_allocator_starting_without_etcd_is_not_restarted_by_its_probes(overlay):
    """etcd unreachable when an allocator pod starts (an etcd outage during a node's restart): the
    process serves its liveness endpoint within the startup probe's budget, so the kubelet does not
    restart it in a loop (and back off for minutes once etcd is back); readiness may wait for etcd."""
    rendered, _ = overlay
    work = Path(tempfile.mkdtemp(prefix="leasehold-pods-"))
    work.chmod(0o755)
    spec = by_kind(rendered, "Deployment")["allocator"]["spec"]["template"]["spec"]
    closed = {f"etcd-{i}.etcd:2379": f"{POD_IP}:{free_port()}" for i in range(3)}
    alloc = Pod("allocator", spec, work / "allocator", closed)
    proc = alloc.start(rendered, work)
    try:
        took = _wait_probe(alloc, proc, "startupProbe")
        print(f"allocator without etcd: live after {took:.1f} s, ready: {alloc.probe('readinessProbe')}")
        liveness = alloc.container["livenessProbe"]
        end = time.monotonic() + liveness["periodSeconds"] * liveness["failureThreshold"] + 2
        while time.monotonic() < end:
            assert alloc.probe("livenessProbe") == 200, proc.tail()
            time.sleep(1)
    finally:
        proc.stop()
        shutil.rmtree(work, ignore_errors=True)
