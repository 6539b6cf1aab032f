"""Process plumbing for the figures: start an agent / echo app / allocator as real processes on
free loopback ports (stopped by PID via :class:`leasehold.local.procs.Proc`), run the load generator
in its own process, read Redis INFO, and a bounded asyncio driver for in-process loops."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis

from leasehold.local.procs import LOOPBACK, EtcdCluster, Proc, RedisServer, free_port, wait_port
from leasehold.local.services import agent_command, allocator_command
from leasehold.local.topology import DEV_PEPPER

REPO = Path(__file__).resolve().parents[1]
NORTHSTAR = REPO / "policies" / "northstar.json"

# The benchmark measures admission and leasing, not credential checks: services it starts (also
# through leasehold.local.topology, which copies this environment) run with authentication disabled,
# like the test suite's. Settings read only known variables, so this is inert where unsupported.
AUTH_OFF = {"LEASEHOLD_AGENT_AUTH_DISABLED": "true", "LEASEHOLD_ALLOCATOR_AUTH_DISABLED": "true"}
for _k, _v in AUTH_OFF.items():
    os.environ.setdefault(_k, _v)


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


@dataclass
class Service:
    proc: Proc
    url: str
    port: int

    def stop(self) -> None:
        self.proc.stop()


def wait_ready(svc: Service, path: str = "/readyz", timeout: float = 60.0) -> Service:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=1.0) as c:
        while time.monotonic() < deadline:
            if not svc.proc.alive():
                raise RuntimeError(f"{svc.proc.name} exited during start-up:\n{svc.proc.tail()}")
            try:
                if c.get(svc.url + path).status_code == 200:
                    return svc
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    svc.stop()
    raise TimeoutError(f"{svc.proc.name} not ready after {timeout}s:\n{svc.proc.tail()}")


def start_agent(workdir: Path, redis_url: str, *, policy: Path = NORTHSTAR, region: str = "bench",
                workers: int = 1, allocator_urls: list[str] | None = None, extra: list[str] | None = None) -> Service:
    port = free_port()
    args = agent_command(*(extra or []), redis_url=redis_url, policy=policy, region=region, host=LOOPBACK, port=port,
                         workers=workers, log_level="warning", allocator_urls=allocator_urls or None)
    proc = Proc(f"agent-{region}-{port}", args, workdir, env=_env(LEASEHOLD_AGENT_PEPPER=DEV_PEPPER)).start()
    svc = Service(proc, f"http://{LOOPBACK}:{port}", port)
    try:
        wait_port(port, proc=proc.popen, timeout=60)
    except BaseException:
        proc.stop()
        raise
    return wait_ready(svc)


def start_echo(workdir: Path, workers: int = 1, module: str = "bench.echo_app") -> Service:
    """An echo server of figure 2: the Litestar echo (``echo_app``) or the raw ASGI one (``raw_echo``)."""
    port = free_port()
    proc = Proc(f"echo-{port}", [sys.executable, "-m", module, "--port", str(port),
                                 "--workers", str(workers)], workdir, env=_env()).start()
    try:
        wait_port(port, proc=proc.popen, timeout=60)
    except BaseException:
        proc.stop()
        raise
    return Service(proc, f"http://{LOOPBACK}:{port}", port)


def start_allocator(workdir: Path, etcd: EtcdCluster, policy: Path, node: str = "bench-1",
                    settings: dict[str, Any] | None = None, lead: bool = True) -> Service:
    """An allocator process (``settings``: more of its settings, e.g. ``shards``); with ``lead``
    (one unsharded replica) wait until it leads."""
    port = free_port()
    url = f"http://{LOOPBACK}:{port}"
    proc = Proc(f"allocator-{node}", allocator_command(etcd=etcd.endpoints, policy=policy, node_id=node, host=LOOPBACK,
                                                        port=port, advertise_url=url, log_level="warning",
                                                        **(settings or {})),
                workdir, env=_env()).start()
    svc = Service(proc, url, port)
    try:
        wait_port(port, proc=proc.popen, timeout=60)
    except BaseException:
        proc.stop()
        raise
    wait_ready(svc)
    if not lead:
        return svc
    # ready means etcd answered; wait until this node leads, so the first grants do not bounce
    deadline = time.monotonic() + 30
    with httpx.Client(timeout=1.0) as c:
        while time.monotonic() < deadline:
            try:
                if c.get(url + "/v1/leader").json().get("isSelf"):
                    return svc
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.1)
    svc.stop()
    raise TimeoutError("allocator did not become leader")


@contextmanager
def services(*items):
    """Stop every started service/server (by PID) on the way out."""
    try:
        yield items
    finally:
        for it in reversed(items):
            it.stop()


def loadgen(cfg: dict, timeout: float | None = None) -> dict:
    """Run the load generator in its own process; its JSON report."""
    limit = timeout or (cfg.get("duration_s", 10) + cfg.get("warmup_s", 0) + 30)
    out = subprocess.run([sys.executable, "-m", "bench.loadgen", json.dumps(cfg)],
                         capture_output=True, text=True, timeout=limit, env=_env(), cwd=REPO)
    if out.returncode != 0:
        raise RuntimeError(f"load generator failed ({out.returncode}):\n{out.stderr[-2000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    if res["sent"] and not res["ok"]:
        raise RuntimeError(f"no successful answer from {cfg['path']}: {res['error_samples']}")
    return res


def redis_client(server: RedisServer) -> redis.Redis:
    return redis.Redis(host=LOOPBACK, port=server.port)


def evalsha_calls(r: redis.Redis) -> int:
    """Script executions so far (EVALSHA + EVAL, pipelined or not) from INFO commandstats."""
    stats = r.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval"))


def used_memory(r: redis.Redis) -> int:
    return int(r.info("memory")["used_memory"])


async def drive(op: Callable[[int], Awaitable[object]], *, concurrency: int, duration_s: float,
                max_ops: int) -> tuple[int, float]:
    """Run ``op(i)`` from ``concurrency`` tasks until ``duration_s`` or ``max_ops``; (ops done, seconds)."""
    state = {"i": 0, "done": 0}
    end = time.perf_counter() + duration_s

    async def worker() -> None:
        while time.perf_counter() < end and state["i"] < max_ops:
            i = state["i"]
            state["i"] += 1
            await op(i)
            state["done"] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return state["done"], time.perf_counter() - t0


def _stat(pid: int | str) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) a process and its live children (e.g. uvicorn workers) have used."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        f = _stat(entry)
        if f is not None and (int(entry) == pid or int(f[1]) == pid):
            total += int(f[11]) + int(f[12])
    return total / os.sysconf("SC_CLK_TCK")


def redis_cpu(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat."""
    vals = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(vals) - idle) / tick, sum(vals) / tick


class CpuMeter:
    """CPU seconds of processes (by PID) and of a Redis (INFO cpu) over a measured interval."""

    def __init__(self, pids: dict[str, int], r: redis.Redis | None = None):
        self.pids, self.r = pids, r

    def __enter__(self) -> CpuMeter:
        self.t0 = time.perf_counter()
        self.c0 = {k: proc_cpu(p) for k, p in self.pids.items()}
        self.rc0 = redis_cpu(self.r) if self.r else 0.0
        self.m0 = machine_busy()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self.t0
        self.cpu = {k: proc_cpu(p) - self.c0[k] for k, p in self.pids.items()}
        if self.r:
            self.cpu["redis"] = redis_cpu(self.r) - self.rc0
        busy, _ = machine_busy()
        self.machine_cores = (busy - self.m0[0]) / self.wall  # every process on the machine, ours or not

    def per(self, units: float) -> dict[str, float]:
        """CPU microseconds per unit of work, per process."""
        return {k: 1e6 * v / units for k, v in self.cpu.items()} if units else {}

    def utilisation(self) -> dict[str, float]:
        out = {k: v / self.wall for k, v in self.cpu.items()}
        out["machine"] = self.machine_cores
        return out


def degraded_counts(svc: Service) -> dict[str, float]:
    """The agent's degraded decisions so far by reason (``leasehold_agent_degraded_decisions_total``)."""
    out: dict[str, float] = {}
    text = httpx.get(svc.url + "/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith("leasehold_agent_degraded_decisions_total{"):
            labels, _, value = line.rpartition(" ")
            reason = labels.split('reason="', 1)[1].split('"', 1)[0] if 'reason="' in labels else "?"
            out[reason] = out.get(reason, 0.0) + float(value)
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}
