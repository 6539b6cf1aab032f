"""kernel.connection_metrics: the ports' connections against their caps as metrics, read at
collection (the caps themselves, against real processes: tests/integration/security/
test_connection_caps.py, which also reads these metrics from ``/metrics``)."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from kernel.connection_metrics import ConnectionMetrics, sockets_on_port
from kernel.httpserver import ConnectionCap


def test_the_connections_accepted_on_a_port_are_counted_and_nothing_else():
    """Accepted sockets count; the listening socket, the client ends (their local port is another)
    and closed ones do not."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert sockets_on_port(port) == 0
        with contextlib.ExitStack() as stack:
            clients = [stack.enter_context(socket.create_connection(("127.0.0.1", port))) for _ in range(3)]
            accepted = [stack.enter_context(listener.accept()[0]) for _ in clients]
            assert sockets_on_port(port) == 3
            accepted[0].close()
            assert sockets_on_port(port) == 2


def test_a_socket_of_another_process_on_the_port_is_not_counted(tmp_path: Path):
    """Several processes may listen on the port (grpc's SO_REUSEPORT, every agent worker): only
    the sockets that are this process's descriptors count."""
    proc = tmp_path / "proc"
    (proc / "net").mkdir(parents=True)
    (proc / "fd").mkdir()
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    rows = [("0100007F:1F90", "00000000:0000", "0A", "100"),  # listening on 8080
            ("0100007F:1F90", "0100007F:A001", "01", "101"),  # accepted, ours
            ("0100007F:1F90", "0100007F:A002", "08", "102"),  # accepted, its peer gone, still ours
            ("0100007F:1F90", "0100007F:A003", "01", "103"),  # accepted by another process
            ("0100007F:1F90", "0100007F:A004", "06", "0"),  # closed (TIME_WAIT: no descriptor)
            ("0100007F:A005", "0100007F:1F90", "01", "105")]  # a client end: its local port is another
    lines = [f"   {i}: {lo} {re} {st} 00000000:00000000 00:00000000 00000000  1000        0 {ino} 1 0\n"
             for i, (lo, re, st, ino) in enumerate(rows)]
    (proc / "net" / "tcp").write_text(header + "".join(lines))
    for fd, inode in enumerate(("100", "101", "102", "105")):
        os.symlink(f"socket:[{inode}]", proc / "fd" / str(fd))
    os.symlink("/dev/null", proc / "fd" / "9")
    assert sockets_on_port(8080, proc=str(proc)) == 2  # no tcp6 table: IPv4 only


class _Serving:
    def __init__(self, cap: ConnectionCap | None):
        self.cap = cap

    def __call__(self) -> ConnectionCap | None:
        return self.cap


def _samples(registry: CollectorRegistry) -> dict[str, float]:
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.split()
            out[name] = float(value)
    return out


def test_every_series_is_there_from_the_start_and_reads_the_cap_at_collection():
    serving = _Serving(None)
    ports: list[int] = []
    metrics = ConnectionMetrics("agent", grpc=True, serving=serving, sockets=lambda p: ports.append(p) or 5)
    registry = CollectorRegistry()
    registry.register(metrics)
    metrics.follow(24)
    assert _samples(registry) == {"leasehold_agent_http_connections": 0, "leasehold_agent_http_max_connections": 24,
                                  "leasehold_agent_http_refused_connections_total": 0,
                                  "leasehold_agent_rls_connections": 0, "leasehold_agent_rls_max_connections": 0}
    assert ports == []  # without a gRPC port nothing is read
    open_now = {object() for _ in range(24)}
    serving.cap = cap = ConnectionCap(24, connections=open_now)
    for n in range(25, 28):  # three past the cap
        cap.at_limit(n)
    metrics.follow(24, rls_port=8081, rls_max_connections=8)
    got = _samples(registry)
    assert got["leasehold_agent_http_connections"] == 24 and got["leasehold_agent_http_refused_connections_total"] == 3
    assert got["leasehold_agent_rls_connections"] == 5 and got["leasehold_agent_rls_max_connections"] == 8
    assert ports == [8081]


def test_the_allocator_has_no_grpc_series():
    metrics = ConnectionMetrics("allocator", serving=_Serving(None))
    metrics.follow(1000)
    registry = CollectorRegistry()
    registry.register(metrics)
    assert set(_samples(registry)) == {"leasehold_allocator_http_connections",
                                       "leasehold_allocator_http_max_connections",
                                       "leasehold_allocator_http_refused_connections_total"}
