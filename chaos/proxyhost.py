"""Every fault proxy of a run, hosted in one child process (``python -m chaos.proxyhost``).

The proxies carry every inter-component link, so whatever stalls them is a network fault. They
used to run on a thread of the chaos runner, which also drives the load, writes the history and
polls the services: a garbage collection or a CPU-heavy moment of the runner (a few hundred ms,
measured in the runner's own send gaps) froze every link at once — to the agents an unrecorded
Redis stall, answered from their in-process allowances. In their own process (uvloop when
installed) they only share the machine.

:class:`ProxyHost` starts the process and adds proxies through its HTTP control endpoint;
:class:`HostedProxy` has the async fault API of :class:`chaos.proxy.FaultProxy`
(``set_faults``/``refuse``/``reset_connections``/``heal``), so every proxy nemesis works on it
unchanged. Control calls:

    POST /proxies                 {"upstreamPort": N, "seed": S|null} -> {"id": I, "port": P}
    GET  /proxies/I/state
    POST /proxies/I/faults|refuse|reset|heal   (as a single proxy's control endpoint)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import httpx
import msgspec

from kernel.errors import BadRequest

from .proxy import LOOPBACK, FaultProxy, ProxyControl, _dispatch, _parse_addr, http_control

MAX_PROXIES = 256


class AddBody(msgspec.Struct, rename="camel", forbid_unknown_fields=True):
    upstream_port: int
    seed: int | None = None


class _Host:
    def __init__(self) -> None:
        self.proxies: list[FaultProxy] = []

    async def dispatch(self, method: str, path: str, raw: bytes) -> dict:
        parts = [p for p in path.split("/") if p]
        if parts[:1] != ["proxies"]:
            raise BadRequest(f"unknown control call {method} {path}")
        if len(parts) == 1 and method == "POST":
            b = msgspec.json.decode(raw or b"{}", type=AddBody)
            if not (1 <= b.upstream_port <= 65535):
                raise BadRequest("upstreamPort must be a TCP port")
            if len(self.proxies) >= MAX_PROXIES:
                raise BadRequest(f"at most {MAX_PROXIES} proxies")
            proxy = await FaultProxy((LOOPBACK, b.upstream_port), seed=b.seed).start()
            self.proxies.append(proxy)
            return {"id": len(self.proxies) - 1, "port": proxy.port}
        if len(parts) == 3 and parts[1].isdigit() and int(parts[1]) < len(self.proxies):
            return await _dispatch(self.proxies[int(parts[1])], method, "/" + parts[2], raw)
        raise BadRequest(f"unknown control call {method} {path}")

    async def stop(self) -> None:
        for p in self.proxies:
            with contextlib.suppress(Exception):
                await p.stop()


async def serve(control: str) -> None:
    host = _Host()
    server = await asyncio.start_server(lambda r, w: http_control(host.dispatch, r, w), *_parse_addr(control),
                                        reuse_address=True)
    print(f"proxy host, control http://{control}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        server.close()
        await host.stop()


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m chaos.proxyhost", description="a run's fault proxies, one process")
    ap.add_argument("--control", required=True, help="127.0.0.1:PORT of the HTTP control endpoint")
    args = ap.parse_args(argv)
    try:
        if _parse_addr(args.control)[0] not in (LOOPBACK, "localhost"):
            raise BadRequest("the control endpoint listens on loopback only")
    except BadRequest as e:
        ap.error(e.detail)
    with contextlib.suppress(KeyboardInterrupt):
        try:
            import uvloop  # the proxies are in every link's data path
        except ImportError:
            asyncio.run(serve(args.control))
        else:
            uvloop.run(serve(args.control))


# ----------------------------------------------------------------------------- the runner's side
class ProxyHost:
    """The proxy host process of a run, stopped by PID in :meth:`stop` (also on failure)."""

    def __init__(self, workdir: Path | None = None, timeout: float = 15.0):
        from leasehold.local.procs import Proc, free_port, wait_port

        self._tmp = None if workdir is not None else tempfile.TemporaryDirectory(prefix="chaos-proxies-")
        self.workdir = workdir if workdir is not None else Path(self._tmp.name)  # type: ignore[union-attr]  # _tmp is set when workdir is None
        self.control_port = free_port()
        self.control = f"http://{LOOPBACK}:{self.control_port}"
        self.proxies: list[HostedProxy] = []
        self.proc = Proc("proxies", [sys.executable, "-m", "chaos.proxyhost", "--control",
                                     f"{LOOPBACK}:{self.control_port}"], self.workdir).start()
        try:
            wait_port(self.control_port, proc=self.proc.popen, timeout=timeout)
        except BaseException:
            self.stop()
            raise

    def alive(self) -> bool:
        return self.proc.alive()

    def add(self, name: str, upstream_port: int, seed: int | None = None) -> HostedProxy:
        """A new proxy to ``upstream_port`` (blocking: called while the topology starts)."""
        r = httpx.post(self.control + "/proxies", json={"upstreamPort": upstream_port, "seed": seed}, timeout=10.0)
        if r.status_code != 200:
            raise BadRequest(f"proxy host: {r.status_code} {r.text}")
        body = r.json()
        hp = HostedProxy(name, int(body["port"]), ProxyControl(f"{self.control}/proxies/{body['id']}", name=name))
        self.proxies.append(hp)
        return hp

    def stop(self) -> None:
        self.proc.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


class HostedProxy:
    """One proxy of the host process, controlled from the runner."""

    def __init__(self, name: str, port: int, control: ProxyControl):
        self.name, self.port, self.control = name, port, control

    @property
    def url_host(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    async def set_faults(self, direction: str = "both", *, latency_ms: float | None = None,
                         jitter_ms: float | None = None, blackhole: bool | None = None,
                         bandwidth_bps: int | None = None) -> None:
        await self.control.set_faults(direction, latency_ms=latency_ms, jitter_ms=jitter_ms, blackhole=blackhole,
                                      bandwidth_bps=bandwidth_bps)

    async def refuse(self, on: bool = True) -> None:
        await self.control.refuse(on)

    async def reset_connections(self) -> int:
        return await self.control.reset_connections()

    async def heal(self) -> None:
        await self.control.heal()

    async def state(self) -> dict:
        return await self.control.state()

    def __repr__(self) -> str:
        return f"proxy({self.name} :{self.port})"


if __name__ == "__main__":
    main()
