"""The connection caps as metrics: how many connections a service's ports hold against their caps,
and how many connections its HTTP port refused (docs/decisions/0075).

Nothing is counted per connection or per request for them: at a collection the HTTP numbers are
read from the serving process's :class:`kernel.httpserver.ConnectionCap` (its refused count, which
the cap keeps anyway, and the length of uvicorn's set of open connections), and the gRPC port's
open connections from the kernel (:func:`sockets_on_port`).

The gRPC port has no refused count: grpc's core closes a connection past
``grpc.max_allowed_incoming_connections`` without telling Python (decision 0071), and a refused
connection leaves nothing the process could count later (it is closed by the server at once, its
socket no longer the process's). What can be measured is how many the port holds open: the
connections whose local port is the gRPC port, in the kernel's socket tables, that are this
process's file descriptors. At ``--rls-max-connections`` of them every new connection is refused.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

_LISTEN = "0A"  # the state column of a listening socket in /proc/net/tcp


def sockets_on_port(port: int, proc: str = "/proc/self") -> int:
    """TCP connections this process holds open whose local port is ``port``: the connections
    accepted on a port it listens on. Read from the kernel's socket tables (``net/tcp``,
    ``net/tcp6``; the listening socket left out) and kept only when the socket is one of the
    process's file descriptors (another process may listen on the same port: grpc sets
    ``SO_REUSEPORT``, every agent worker binds the port). A connection the server has closed is no
    longer its descriptor and is not counted, whatever state its socket is left in."""
    tail = f":{port:04X}"
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"{proc}/net/{table}") as f:
                next(f, None)  # the header
                for line in f:
                    fields = line.split()
                    if len(fields) > 9 and fields[1].endswith(tail) and fields[3] != _LISTEN:
                        inodes.add(fields[9])
        except FileNotFoundError:  # no IPv6 in this kernel
            continue
    inodes.discard("0")
    if not inodes:
        return 0
    held = 0
    with os.scandir(f"{proc}/fd") as fds:
        for fd in fds:
            try:
                link = os.readlink(fd.path)
            except OSError:  # closed meanwhile
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                held += 1
    return held


class ConnectionMetrics:
    """A collector of a service's connection metrics (``leasehold_<service>_http_*``, and with
    ``grpc`` the agent's ``leasehold_agent_rls_*``), every series exported from the start: the
    refused count at 0, the gRPC ones at 0 without a gRPC port. ``follow`` names the caps in force;
    ``serving`` gives the HTTP server's cap (None before its first connection)."""

    LABELS = ()

    def __init__(self, service: str, *, grpc: bool = False, workers: bool = False,
                 serving: Callable[[], Any] | None = None, sockets: Callable[[int], int] = sockets_on_port):
        prefix = f"leasehold_{service}_"
        self.names = {"http_open": prefix + "http_connections", "http_max": prefix + "http_max_connections",
                      "http_refused": prefix + "http_refused_connections"}
        fullest = "; with several workers, the worker holding the most" if workers else ""
        each = " (each worker its own)" if workers else ""
        self.help = {
            "http_open": "HTTP connections the process holds open (one being refused until it is closed)" + fullest,
            "http_max": f"--http-max-connections: the HTTP connections one process keeps open{each}; one more is "
                        "answered 503 too-many-connections and closed",
            "http_refused": "HTTP connections answered 503 too-many-connections and closed because the process "
                            "held --http-max-connections" + (" (every worker's)" if workers else "")}
        if grpc:
            self.names.update(rls_open=prefix + "rls_connections", rls_max=prefix + "rls_max_connections")
            self.help.update(
                rls_open="Connections the gRPC port (--rls-port) holds open, read from the kernel's socket tables "
                         f"(0 without --rls-port){fullest}. grpc reports no refused connection: at "
                         "--rls-max-connections every new one is refused",
                rls_max=f"--rls-max-connections: the connections the gRPC port keeps open{each}; one more is "
                        "closed as soon as it is accepted (0 without --rls-port)")
        self.http_max = 0
        self.rls_port = 0
        self.rls_max = 0
        if serving is None:
            from .httpserver import serving_cap
            serving = serving_cap
        self._serving = serving
        self._sockets = sockets

    def follow(self, http_max_connections: int, rls_port: int = 0, rls_max_connections: int = 0) -> None:
        self.http_max = http_max_connections
        self.rls_port = rls_port
        self.rls_max = rls_max_connections if rls_port else 0

    def read(self) -> dict[str, float]:
        """The values now, by key of :attr:`names`."""
        cap = self._serving()
        out = {"http_open": float(cap.open if cap is not None else 0),
               "http_max": float(self.http_max or (cap.limit if cap is not None else 0)),
               "http_refused": float(cap.refused if cap is not None else 0)}
        if "rls_open" in self.names:
            out["rls_open"] = float(self._sockets(self.rls_port) if self.rls_port else 0)
            out["rls_max"] = float(self.rls_max)
        return out

    def _family(self, key: str, value: float | None = None) -> Metric:
        kind = CounterMetricFamily if key == "http_refused" else GaugeMetricFamily
        return kind(self.names[key], self.help[key], value=value)

    def describe(self) -> list[Metric]:
        return [self._family(key) for key in self.names]

    def collect(self) -> Iterator[Metric]:
        for key, value in self.read().items():
            yield self._family(key, value)

    def mirror(self) -> Callable[[], None]:
        """Several workers (prometheus_client's multiprocess mode): metrics kept in the shared
        files, and the function that moves this worker's values into them (run at every flush).
        The refused counts are summed over the workers; the gauges are the highest worker's."""
        from prometheus_client import Counter, Gauge

        gauges = {key: Gauge(name, self.help[key], registry=None, multiprocess_mode="livemax")
                  for key, name in self.names.items() if key != "http_refused"}
        refused = Counter(self.names["http_refused"], self.help["http_refused"], registry=None)
        sent = [0.0]

        def push() -> None:
            values = self.read()
            for key, gauge in gauges.items():
                gauge.set(values[key])
            n = values["http_refused"]
            if n > sent[0]:
                refused.inc(n - sent[0])
                sent[0] = n

        refused.inc(0)  # the series from the start
        return push


__all__ = ["ConnectionMetrics", "sockets_on_port"]
