"""Fault proxies hosted on their own event loop in a background thread.

The chaos runner's own loop is busy driving load; the proxies that carry every
inter-component link run on a separate loop so a burst of load-generator work does not
stall the links it is measuring. :class:`HostedProxy` has the async fault API of
:class:`chaos.proxy.FaultProxy` (``set_faults``/``refuse``/``reset_connections``/``heal``),
callable from any other loop, so every proxy nemesis works on it unchanged.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

from .proxy import LOOPBACK, FaultProxy


class ProxyHost:
    """A thread running one event loop that hosts every proxy of a run. ``stop`` closes all."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="chaos-proxies", daemon=True)
        self.proxies: list[HostedProxy] = []
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 10.0) -> Any:
        """Run ``coro`` on the host loop and wait for it (from a thread that is not the host's)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def add(self, name: str, upstream_port: int, seed: int | None = None) -> HostedProxy:
        async def make() -> FaultProxy:
            return await FaultProxy((LOOPBACK, upstream_port), seed=seed).start()

        hp = HostedProxy(name, self, self.call(make()))
        self.proxies.append(hp)
        return hp

    def stop(self) -> None:
        if not self.loop.is_running():
            return
        for p in self.proxies:
            try:
                self.call(p.proxy.stop(), timeout=5.0)
            except Exception:  # noqa: BLE001 - stopping everything regardless
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)


class HostedProxy:
    """One proxy on the host loop, controlled from another loop (the runner's)."""

    def __init__(self, name: str, host: ProxyHost, proxy: FaultProxy):
        self.name, self.host, self.proxy = name, host, proxy

    @property
    def port(self) -> int:
        return self.proxy.port

    @property
    def url_host(self) -> str:
        return f"{LOOPBACK}:{self.proxy.port}"

    async def _on_host(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.host.loop))

    async def set_faults(self, direction: str = "both", *, latency_ms: float | None = None,
                         jitter_ms: float | None = None, blackhole: bool | None = None,
                         bandwidth_bps: int | None = None) -> None:
        await self._on_host(self.proxy.set_faults(direction, latency_ms=latency_ms, jitter_ms=jitter_ms,
                                                  blackhole=blackhole, bandwidth_bps=bandwidth_bps))

    async def refuse(self, on: bool = True) -> None:
        await self._on_host(self.proxy.refuse(on))

    async def reset_connections(self) -> int:
        return int(await self._on_host(self.proxy.reset_connections()))

    async def heal(self) -> None:
        await self._on_host(self.proxy.heal())

    def __repr__(self) -> str:
        return f"proxy({self.name} :{self.port})"
