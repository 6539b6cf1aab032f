"""A fault-injecting TCP proxy for one link (e.g. agent -> allocator, agent -> redis).

asyncio, loopback only. Faults are set at run time per direction (``up`` = client ->
upstream, ``down`` = upstream -> client) and combine:

* latency + jitter: every chunk is delivered ``latency ± jitter`` ms after it was read,
  order preserved (loss on TCP shows up as exactly this: stalls and delay);
* blackhole: stop moving bytes in that direction — nothing is read from the sender and
  nothing queued is delivered, so the kernel buffers fill and the sender stalls, like a
  partition that drops every packet. Healing delivers what was held (as TCP retransmission
  would); new connections are still accepted, as a SYN to a partitioned host is not refused;
* bandwidth cap (bytes/s);
* refuse: stop listening, so new connections get ECONNREFUSED; existing ones are untouched;
* reset: abort every open connection with an RST.

Controlled in process (:class:`FaultProxy`, all methods on its own event loop) or from
another process through a tiny HTTP control endpoint on loopback::

    python -m chaos.proxy --listen 127.0.0.1:P --upstream 127.0.0.1:Q --control 127.0.0.1:C

    GET  /state                      -> {"faults": {...}, "refusing": false, "connections": 2}
    POST /faults   {"direction": "up|down|both", "latencyMs": 50, "jitterMs": 10,
                    "blackhole": true, "bandwidthBps": 0}   (omitted fields unchanged)
    POST /refuse   {"on": true}
    POST /reset
    POST /heal                       -> clear every fault and listen again

:class:`ProxyControl` is the async client for that endpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import random
import signal
import socket
import ssl
import struct
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgspec

from kernel.errors import BadRequest

LOOPBACK = "127.0.0.1"
DIRECTIONS = ("up", "down")
CHUNK = 65536
QUEUE_CHUNKS = 64  # per direction: bounded, the reader waits when the writer is behind
MAX_DELAY_MS = 600_000
MAX_CONNECTIONS = 1024
CONTROL_MAX_BODY = 4096


@dataclass
class LinkFaults:
    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    blackhole: bool = False
    bandwidth_bps: int = 0  # 0 = unlimited

    def delay_s(self, rng: random.Random) -> float:
        if self.latency_ms <= 0 and self.jitter_ms <= 0:
            return 0.0
        jitter = rng.uniform(-self.jitter_ms, self.jitter_ms) if self.jitter_ms else 0.0
        return max(0.0, self.latency_ms + jitter) / 1000.0


@dataclass
class _Direction:
    faults: LinkFaults = field(default_factory=LinkFaults)
    open: asyncio.Event = field(default_factory=asyncio.Event)  # set = not blackholed

    def __post_init__(self) -> None:
        self.open.set()


def _parse_addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise BadRequest(f"address must be host:port, got {text!r}")
    return host, int(port)


def _directions(direction: str) -> Sequence[str]:
    if direction == "both":
        return DIRECTIONS
    if direction in DIRECTIONS:
        return (direction,)
    raise BadRequest(f"direction must be up, down or both, got {direction!r}")


class FaultProxy:
    """One listener forwarding to one upstream. Create and use it inside a running loop."""

    def __init__(self, upstream: tuple[str, int], listen: tuple[str, int] = (LOOPBACK, 0),
                 *, seed: int | None = None, connect_timeout: float = 5.0):
        if listen[0] not in (LOOPBACK, "localhost"):
            raise BadRequest(f"the fault proxy listens on loopback only, not {listen[0]!r}")
        self.upstream = upstream
        self.host, self.port = listen
        self.connect_timeout = connect_timeout
        self._rng = random.Random(seed)
        self._dirs = {d: _Direction() for d in DIRECTIONS}
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[_Conn] = set()
        self.refusing = False
        self.accepted = 0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> FaultProxy:
        await self._listen()
        return self

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._on_client, self.host, self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        await self._close_listener()
        await self.reset_connections()

    async def _close_listener(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            self._server = None

    async def __aenter__(self) -> FaultProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    # ------------------------------------------------------------------ faults
    async def set_faults(self, direction: str = "both", *, latency_ms: float | None = None,
                         jitter_ms: float | None = None, blackhole: bool | None = None,
                         bandwidth_bps: int | None = None) -> None:
        for name, value, hi in (("latency_ms", latency_ms, MAX_DELAY_MS), ("jitter_ms", jitter_ms, MAX_DELAY_MS),
                                ("bandwidth_bps", bandwidth_bps, 2**40)):
            if value is not None and not (0 <= value <= hi):
                raise BadRequest(f"{name} must be in [0, {hi}], got {value!r}")
        for d in _directions(direction):
            state = self._dirs[d]
            f = state.faults
            if latency_ms is not None:
                f.latency_ms = float(latency_ms)
            if jitter_ms is not None:
                f.jitter_ms = float(jitter_ms)
            if bandwidth_bps is not None:
                f.bandwidth_bps = int(bandwidth_bps)
            if blackhole is not None:
                f.blackhole = bool(blackhole)
                if blackhole:
                    state.open.clear()
                else:
                    state.open.set()

    async def blackhole(self, direction: str = "both", on: bool = True) -> None:
        await self.set_faults(direction, blackhole=on)

    async def latency(self, ms: float, jitter_ms: float = 0.0, direction: str = "both") -> None:
        await self.set_faults(direction, latency_ms=ms, jitter_ms=jitter_ms)

    async def refuse(self, on: bool = True) -> None:
        """Stop (or resume) listening: new connections are refused, open ones keep going."""
        if on and not self.refusing:
            self.refusing = True
            await self._close_listener()
        elif not on and self.refusing:
            self.refusing = False
            await self._listen()

    async def reset_connections(self) -> int:
        """Abort every open connection with an RST on both sides. Returns how many."""
        conns = list(self._conns)
        for c in conns:
            c.abort()
        return len(conns)

    async def heal(self) -> None:
        for d in DIRECTIONS:
            await self.set_faults(d, latency_ms=0, jitter_ms=0, blackhole=False, bandwidth_bps=0)
        await self.refuse(False)

    def state(self) -> dict:
        return {"listen": f"{self.host}:{self.port}", "upstream": f"{self.upstream[0]}:{self.upstream[1]}",
                "faults": {d: asdict(s.faults) for d, s in self._dirs.items()},
                "refusing": self.refusing, "connections": len(self._conns), "accepted": self.accepted}

    # ------------------------------------------------------------------ data path
    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if len(self._conns) >= MAX_CONNECTIONS:
            _abort(writer)
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*self.upstream),
                                                          self.connect_timeout)
        except (OSError, TimeoutError):
            _abort(writer)  # upstream down: the client sees a reset, as it would from the host
            return
        conn = _Conn(self, reader, writer, up_reader, up_writer)
        self._conns.add(conn)
        try:
            await conn.run()
        finally:
            self._conns.discard(conn)


def _abort(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class _Conn:
    def __init__(self, proxy: FaultProxy, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter,
                 u_reader: asyncio.StreamReader, u_writer: asyncio.StreamWriter):
        self.proxy = proxy
        self.c_writer, self.u_writer = c_writer, u_writer
        self.paths = (("up", c_reader, u_writer), ("down", u_reader, c_writer))
        self.tasks: list[asyncio.Task] = []

    async def run(self) -> None:
        for name, src, dst in self.paths:
            q: asyncio.Queue = asyncio.Queue(QUEUE_CHUNKS)
            self.tasks.append(asyncio.create_task(self._read(name, src, q)))
            self.tasks.append(asyncio.create_task(self._write(name, dst, q)))
        try:
            # the connection ends when both writers finished (EOF forwarded) or anything failed
            done, pending = await asyncio.wait(self.tasks, return_when=asyncio.FIRST_EXCEPTION)
            if any(t.exception() for t in done if not t.cancelled()):
                self.abort()
        finally:
            for t in self.tasks:
                t.cancel()
            for w in (self.c_writer, self.u_writer):
                w.close()

    async def _read(self, name: str, src: asyncio.StreamReader, q: asyncio.Queue) -> None:
        d = self.proxy._dirs[name]
        loop = asyncio.get_running_loop()
        last_due = 0.0
        while True:
            await d.open.wait()
            data = await src.read(CHUNK)
            due = max(last_due, loop.time() + d.faults.delay_s(self.proxy._rng))
            last_due = due
            await q.put((due, data))
            if not data:
                return

    async def _write(self, name: str, dst: asyncio.StreamWriter, q: asyncio.Queue) -> None:
        d = self.proxy._dirs[name]
        loop = asyncio.get_running_loop()
        while True:
            due, data = await q.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            await d.open.wait()
            if not data:
                if dst.can_write_eof():
                    dst.write_eof()
                return
            bps = d.faults.bandwidth_bps
            if bps:  # pace before writing: a chunk is never delivered before its bytes "arrived"
                await asyncio.sleep(len(data) / bps)
            dst.write(data)
            await dst.drain()

    def abort(self) -> None:
        for t in self.tasks:
            t.cancel()
        _abort(self.c_writer)
        _abort(self.u_writer)


# ============================================================================ control endpoint
class FaultsBody(msgspec.Struct, rename="camel", forbid_unknown_fields=True):
    direction: str = "both"
    latency_ms: float | None = None
    jitter_ms: float | None = None
    blackhole: bool | None = None
    bandwidth_bps: int | None = None


class RefuseBody(msgspec.Struct, forbid_unknown_fields=True):
    on: bool = True


async def _control_handler(proxy: FaultProxy, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    async def dispatch(method: str, path: str, raw: bytes) -> dict:
        return await _dispatch(proxy, method, path, raw)

    await http_control(dispatch, reader, writer)


async def http_control(dispatch, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> None:
    """One minimal HTTP/1.1 request (Connection: close) -> ``dispatch(method, path, body)`` -> JSON."""
    status, body = 200, {}
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        length = 0
        for line in lines[1:]:
            k, _, v = line.partition(":")
            if k.strip().lower() == "content-length":
                length = int(v.strip())
        if length > CONTROL_MAX_BODY:
            raise BadRequest("control body too large")
        raw = await asyncio.wait_for(reader.readexactly(length), 5.0) if length else b""
        body = await dispatch(method, path, raw)
    except BadRequest as e:
        status, body = 400, {"error": e.detail}
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        status, body = 400, {"error": str(e)}
    except (ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError) as e:
        status, body = 400, {"error": f"malformed request: {e}"}
    payload = msgspec.json.encode(body)
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}.get(status, "Error")
    with contextlib.suppress(ConnectionError):
        writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
        await writer.drain()
    writer.close()


async def _dispatch(proxy: FaultProxy, method: str, path: str, raw: bytes) -> dict:
    """The control calls of one proxy: ``GET /state``, ``POST /faults|/refuse|/reset|/heal``."""
    if method == "GET" and path == "/state":
        return proxy.state()
    if method != "POST":
        raise BadRequest(f"unknown control call {method} {path}")
    if path == "/faults":
        b = msgspec.json.decode(raw or b"{}", type=FaultsBody)
        await proxy.set_faults(b.direction, latency_ms=b.latency_ms, jitter_ms=b.jitter_ms,
                               blackhole=b.blackhole, bandwidth_bps=b.bandwidth_bps)
    elif path == "/refuse":
        await proxy.refuse(msgspec.json.decode(raw or b"{}", type=RefuseBody).on)
    elif path == "/reset":
        return {"reset": await proxy.reset_connections()}
    elif path == "/heal":
        await proxy.heal()
    else:
        raise BadRequest(f"unknown control call {method} {path}")
    return proxy.state()


async def start_control(proxy: FaultProxy, listen: tuple[str, int]) -> asyncio.base_events.Server:
    if listen[0] not in (LOOPBACK, "localhost"):
        raise BadRequest("the control endpoint listens on loopback only")

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _control_handler(proxy, r, w)

    return await asyncio.start_server(handle, *listen, reuse_address=True)


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One TLS context for every control client of this process. The control endpoint is plain
    HTTP on loopback, but a new ``httpx.AsyncClient`` builds a context (loading the CA bundle)
    whenever it is not given one: 0.1-0.15 s of CPU per call on a machine with both cores busy,
    by which a fault's start was late."""
    import httpx

    return httpx.create_ssl_context()


class ProxyControl:
    """Async client for a proxy's control endpoint (another process)."""

    def __init__(self, control: str, name: str | None = None, timeout: float = 5.0):
        self.base = control if control.startswith("http") else f"http://{control}"
        self.name = name or self.base
        self.timeout = timeout

    async def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        import httpx

        async with httpx.AsyncClient(timeout=self.timeout, verify=_tls_context()) as c:
            r = await c.request(method, self.base + path, json=body)
        if r.status_code != 200:
            raise BadRequest(f"proxy control {path}: {r.status_code} {r.text}")
        return r.json()

    async def state(self) -> dict:
        return await self._call("GET", "/state")

    async def set_faults(self, direction: str = "both", *, latency_ms: float | None = None,
                         jitter_ms: float | None = None, blackhole: bool | None = None,
                         bandwidth_bps: int | None = None) -> None:
        body = {"direction": direction, "latencyMs": latency_ms, "jitterMs": jitter_ms,
                "blackhole": blackhole, "bandwidthBps": bandwidth_bps}
        await self._call("POST", "/faults", {k: v for k, v in body.items() if v is not None or k == "direction"})

    async def blackhole(self, direction: str = "both", on: bool = True) -> None:
        await self.set_faults(direction, blackhole=on)

    async def latency(self, ms: float, jitter_ms: float = 0.0, direction: str = "both") -> None:
        await self.set_faults(direction, latency_ms=ms, jitter_ms=jitter_ms)

    async def refuse(self, on: bool = True) -> None:
        await self._call("POST", "/refuse", {"on": on})

    async def reset_connections(self) -> int:
        return int((await self._call("POST", "/reset"))["reset"])

    async def heal(self) -> None:
        await self._call("POST", "/heal")


class ProxyProcess:
    """``python -m chaos.proxy`` as a child process on free loopback ports, stopped by PID;
    ``control`` flips its faults from this process (the scenario runner)."""

    def __init__(self, upstream: tuple[str, int], workdir: Path, name: str = "proxy", seed: int | None = None):
        from leasehold.local.procs import Proc, free_port

        self.upstream = upstream
        self.port, self.control_port = free_port(), free_port()
        args = [sys.executable, "-m", "chaos.proxy", "--listen", f"{LOOPBACK}:{self.port}",
                "--upstream", f"{upstream[0]}:{upstream[1]}", "--control", f"{LOOPBACK}:{self.control_port}"]
        if seed is not None:
            args += ["--seed", str(seed)]
        self.proc = Proc(name, args, workdir)
        self.control = ProxyControl(f"{LOOPBACK}:{self.control_port}", name=name)

    @property
    def address(self) -> tuple[str, int]:
        return (LOOPBACK, self.port)

    def start(self, timeout: float = 15.0) -> ProxyProcess:
        from leasehold.local.procs import wait_port

        self.proc.start()
        try:
            wait_port(self.port, proc=self.proc.popen, timeout=timeout)
            wait_port(self.control_port, proc=self.proc.popen, timeout=timeout)
        except BaseException:
            self.proc.stop()
            raise
        return self

    def stop(self) -> None:
        self.proc.stop()


# ============================================================================ CLI
async def serve(listen: str, upstream: str, control: str | None, seed: int | None = None,
                duration: float | None = None) -> None:
    proxy = await FaultProxy(_parse_addr(upstream), _parse_addr(listen), seed=seed).start()
    ctl = await start_control(proxy, _parse_addr(control)) if control else None
    print(f"fault proxy {proxy.host}:{proxy.port} -> {upstream}"
          + (f", control http://{control}" if control else ""), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), duration)
    finally:
        if ctl is not None:
            ctl.close()
        await proxy.stop()


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m chaos.proxy", description="fault-injecting TCP proxy (loopback)")
    ap.add_argument("--listen", required=True, help="127.0.0.1:PORT")
    ap.add_argument("--upstream", required=True, help="HOST:PORT")
    ap.add_argument("--control", help="127.0.0.1:PORT of the HTTP control endpoint")
    ap.add_argument("--seed", type=int, default=None, help="jitter RNG seed")
    ap.add_argument("--duration", type=float, default=None, help="exit after this many seconds")
    args = ap.parse_args(argv)
    try:
        for a in (args.listen, args.upstream) + ((args.control,) if args.control else ()):
            _parse_addr(a)
        for a in (args.listen,) + ((args.control,) if args.control else ()):
            if _parse_addr(a)[0] not in (LOOPBACK, "localhost"):
                raise BadRequest(f"{a}: the proxy and its control endpoint listen on loopback only")
    except BadRequest as e:
        ap.error(e.detail)
    coro = serve(args.listen, args.upstream, args.control, args.seed, args.duration)
    with contextlib.suppress(KeyboardInterrupt):
        try:
            import uvloop  # a faster loop for a proxy in the data path, when installed
        except ImportError:
            asyncio.run(coro)
        else:
            uvloop.run(coro)


if __name__ == "__main__":
    main()
