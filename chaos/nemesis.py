"""Nemeses: named faults with start/stop, recorded in the history, combinable and schedulable.

Every nemesis is async (``await n.start()`` / ``await n.stop()``); blocking work (restarting a
process and waiting for its port) runs in a thread. ``stop`` is idempotent and every nemesis
writes one ``fault`` record (name, target, start and stop on the recorder clock) when it
stops. :class:`Schedule` runs nemeses at offsets within a bounded duration and always stops
whatever it started, also when cancelled or failing.

Process nemeses act on :class:`leasehold.local.procs.Proc` (signals by PID). Network nemeses act
on a fault proxy — a :class:`chaos.proxy.FaultProxy` in this process or a
:class:`chaos.proxy.ProxyControl` for a proxy process — or on iptables rules owned by
:mod:`chaos.netns` (namespaces, cgroup-scoped etcd isolation). Clock faults are applied when a
service starts: :func:`faketime_prefix` / :func:`faketime_env` here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kernel.errors import BadRequest
from leasehold.local.procs import EtcdCluster, Proc, RedisServer, wait_port

from .history import Fault, now_ms

MAX_SCHEDULE_S = 3600.0
MAX_STEPS = 256


class FaultRecorder(Protocol):
    def write(self, rec: Fault) -> None: ...  # noqa: E704


class ProxyLike(Protocol):
    async def set_faults(self, direction: str = "both", *, latency_ms: float | None = None,
                         jitter_ms: float | None = None, blackhole: bool | None = None,
                         bandwidth_bps: int | None = None) -> None: ...  # noqa: E704

    async def refuse(self, on: bool = True) -> None: ...  # noqa: E704

    async def reset_connections(self) -> int: ...  # noqa: E704


@dataclass(frozen=True)
class Effects:
    """What a fault makes unreachable — the fault terms of the overshoot bound
    (:mod:`kernel.bound`), written into its ``fault`` record for the checker: regions that cannot
    reach the allocator, agents that cannot reach their Redis, agents restarted (at the fault's
    stop), and how long after the stop the effect may last (``grace_ms``)."""

    allocator_regions: tuple[str, ...] = ()
    redis_agents: tuple[str, ...] = ()
    restarted_agents: tuple[str, ...] = ()
    grace_ms: int = 0
    envoys: tuple[str, ...] = ()  # Envoys (RLQS) cut off from their agent: their fallback behaviour decides

    def __add__(self, other: Effects) -> Effects:
        def merge(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(dict.fromkeys(a + b))

        return Effects(merge(self.allocator_regions, other.allocator_regions),
                       merge(self.redis_agents, other.redis_agents),
                       merge(self.restarted_agents, other.restarted_agents), max(self.grace_ms, other.grace_ms),
                       merge(self.envoys, other.envoys))


NO_EFFECTS = Effects()


class Nemesis:
    """Base class. Subclasses implement ``_start`` / ``_stop``."""

    name = "nemesis"

    def __init__(self, target: str, *, recorder: FaultRecorder | None = None, detail: str = "",
                 effects: Effects = NO_EFFECTS):
        self.target = target
        self.recorder = recorder
        self.detail = detail
        self.effects = effects
        self.started_ms: int | None = None
        self.stopped_ms: int | None = None
        self.records: list[Fault] = []

    @property
    def active(self) -> bool:
        return self.started_ms is not None and self.stopped_ms is None

    async def start(self) -> None:
        if self.active:
            return
        self.stopped_ms = None
        self.started_ms = now_ms()
        await self._start()

    async def stop(self) -> None:
        if not self.active:
            return
        try:
            await self._stop()
        finally:
            self.stopped_ms = now_ms()
            e = self.effects
            rec = Fault(nemesis=self.name, target=self.target, start_ms=self.started_ms or self.stopped_ms,
                        stop_ms=self.stopped_ms, detail=self.detail, allocator_regions=list(e.allocator_regions),
                        redis_agents=list(e.redis_agents), restarted_agents=list(e.restarted_agents),
                        grace_ms=e.grace_ms, envoys_cut_off=list(e.envoys))
            self.records.append(rec)
            if self.recorder is not None:
                self.recorder.write(rec)

    async def _start(self) -> None:
        raise NotImplementedError

    async def _stop(self) -> None:
        raise NotImplementedError

    @contextlib.asynccontextmanager
    async def active_for(self):
        """``async with nemesis.active_for(): ...`` — the fault holds inside the block."""
        await self.start()
        try:
            yield self
        finally:
            await self.stop()

    def __repr__(self) -> str:
        return f"{self.name}({self.target})"


# ----------------------------------------------------------------------------- network (proxy)
class Partition(Nemesis):
    """Blackhole a proxied link, both ways or one (``up`` = client -> upstream)."""

    name = "partition"

    def __init__(self, proxy: ProxyLike, direction: str = "both", *, target: str = "link", **kw):
        if direction not in ("up", "down", "both"):
            raise BadRequest(f"direction must be up, down or both, got {direction!r}")
        super().__init__(target, detail=f"direction={direction}", **kw)
        self.proxy, self.direction = proxy, direction

    async def _start(self) -> None:
        await self.proxy.set_faults(self.direction, blackhole=True)

    async def _stop(self) -> None:
        await self.proxy.set_faults(self.direction, blackhole=False)


class Latency(Nemesis):
    name = "latency"

    def __init__(self, proxy: ProxyLike, ms: float, jitter: float = 0.0, direction: str = "both", *,
                 target: str = "link", **kw):
        if not (0 <= ms <= 600_000 and 0 <= jitter <= 600_000):
            raise BadRequest("latency and jitter must be in [0, 600000] ms")
        super().__init__(target, detail=f"{ms}±{jitter} ms {direction}", **kw)
        self.proxy, self.ms, self.jitter, self.direction = proxy, ms, jitter, direction

    async def _start(self) -> None:
        await self.proxy.set_faults(self.direction, latency_ms=self.ms, jitter_ms=self.jitter)

    async def _stop(self) -> None:
        await self.proxy.set_faults(self.direction, latency_ms=0, jitter_ms=0)


class Refuse(Nemesis):
    """New connections to the link are refused (the upstream looks down); open ones reset
    too when ``reset`` is set."""

    name = "refuse"

    def __init__(self, proxy: ProxyLike, *, reset: bool = True, target: str = "link", **kw):
        super().__init__(target, detail="reset open connections" if reset else "", **kw)
        self.proxy, self.reset = proxy, reset

    async def _start(self) -> None:
        await self.proxy.refuse(True)
        if self.reset:
            await self.proxy.reset_connections()

    async def _stop(self) -> None:
        await self.proxy.refuse(False)


# ----------------------------------------------------------------------------- processes
async def _in_thread(fn: Callable[[], object]) -> None:
    await asyncio.to_thread(fn)


class Kill(Nemesis):
    """SIGKILL a process at start; restart it (same args) at stop unless ``restart=False``.
    ``ready`` (blocking, e.g. waiting for its port) runs after the restart."""

    name = "kill"

    def __init__(self, proc: Proc, *, restart: bool = True, ready: Callable[[Proc], None] | None = None, **kw):
        super().__init__(proc.name, detail="" if restart else "no restart", **kw)
        self.proc, self.restart, self.ready = proc, restart, ready

    async def _start(self) -> None:
        await _in_thread(self.proc.kill)

    async def _stop(self) -> None:
        if not self.restart:
            return

        def again() -> None:
            self.proc.start()
            if self.ready is not None:
                self.ready(self.proc)

        await _in_thread(again)


def port_ready(port: int, timeout: float = 15.0) -> Callable[[Proc], None]:
    """A ``ready`` callback for :class:`Kill`: wait until the restarted process listens."""

    def ready(proc: Proc) -> None:
        wait_port(port, proc=proc.popen, timeout=timeout)

    return ready


class Pause(Nemesis):
    """SIGSTOP at start, SIGCONT at stop: the process holds its sockets but answers nothing."""

    name = "pause"

    def __init__(self, proc: Proc, **kw):
        super().__init__(proc.name, **kw)
        self.proc = proc

    async def _start(self) -> None:
        self.proc.signal(signal.SIGSTOP)

    async def _stop(self) -> None:
        self.proc.signal(signal.SIGCONT)


class RedisRestart(Nemesis):
    """SIGKILL a redis-server at start and start it again on the same port at stop: with
    persistence off (as :class:`leasehold.local.procs.RedisServer` runs it) every key and the script
    cache are gone, so clients see NOSCRIPT and empty state."""

    name = "redis-restart"

    def __init__(self, server: RedisServer, **kw):
        super().__init__(f"redis:{server.port}", **kw)
        self.server = server

    async def _start(self) -> None:
        assert self.server.proc is not None, "redis server not started"
        await _in_thread(self.server.proc.kill)

    async def _stop(self) -> None:
        await _in_thread(self.server.start)


class EtcdMemberKill(Kill):
    """Kill (and restart) one member of an :class:`EtcdCluster`, waiting for its client port."""

    name = "etcd-member-kill"

    def __init__(self, cluster: EtcdCluster, index: int, **kw):
        super().__init__(cluster.procs[index], ready=port_ready(cluster.client_ports[index]), **kw)


class EtcdMemberIsolate(Nemesis):
    """Cut one etcd member off from its peers (clients can still connect to it; anything that
    needs quorum through it stalls). Real packet drops: iptables rules scoped by port and by a
    cgroup the member is moved into (see :class:`chaos.netns.MemberIsolation`)."""

    name = "etcd-member-isolate"

    def __init__(self, cluster: EtcdCluster, index: int, **kw):
        super().__init__(f"etcd:{cluster.member_name(index)}", **kw)
        self.cluster, self.index = cluster, index
        self._iso = None

    async def _start(self) -> None:
        from .netns import MemberIsolation

        others = [p for j, p in enumerate(self.cluster.peer_ports) if j != self.index]
        self._iso = MemberIsolation(self.cluster.procs[self.index].pid, self.cluster.peer_ports[self.index], others)
        await _in_thread(self._iso.apply)

    async def _stop(self) -> None:
        if self._iso is not None:
            await _in_thread(self._iso.remove)
            self._iso = None


class Custom(Nemesis):
    """Any start/stop pair of async callables (e.g. replaying a stale-epoch grant, publishing a
    rolled-back bundle as a new version)."""

    def __init__(self, name: str, target: str, start: Callable[[], object], stop: Callable[[], object] | None = None,
                 **kw):
        super().__init__(target, **kw)
        self.name = name
        self._on_start, self._on_stop = start, stop

    async def _start(self) -> None:
        r = self._on_start()
        if asyncio.iscoroutine(r):
            await r

    async def _stop(self) -> None:
        if self._on_stop is not None:
            r = self._on_stop()
            if asyncio.iscoroutine(r):
                await r


class Combined(Nemesis):
    """Several nemeses started together and stopped together (in reverse order)."""

    name = "combined"

    def __init__(self, *parts: Nemesis, **kw):
        kw.setdefault("effects", sum((p.effects for p in parts), NO_EFFECTS))
        super().__init__("+".join(p.target for p in parts), detail=" + ".join(p.name for p in parts), **kw)
        self.parts = parts

    async def _start(self) -> None:
        for p in self.parts:
            await p.start()

    async def _stop(self) -> None:
        errors: list[BaseException] = []
        for p in reversed(self.parts):
            try:
                await p.stop()
            except Exception as e:  # stop every part even if one fails
                errors.append(e)
        if errors:
            raise errors[0]


# ----------------------------------------------------------------------------- clocks
FAKETIME_LIBS = ("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
                 "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
                 "/usr/lib/faketime/libfaketimeMT.so.1")


def faketime_spec(skew_s: float = 0.0, rate: float | None = None) -> str:
    """libfaketime's spec: ``+3s`` (a skew), ``+0 x1.1`` (a drift: the clock runs 1.1x), or both."""
    if not (-86_400 * 365 <= skew_s <= 86_400 * 365):
        raise BadRequest("skew must be within a year")
    if rate is not None and not (0.01 <= rate <= 100):
        raise BadRequest("rate must be in [0.01, 100]")
    spec = f"{skew_s:+g}s" if rate is None else f"{skew_s:+g} x{rate:g}"
    return spec


def faketime_prefix(skew_s: float = 0.0, rate: float | None = None) -> list[str]:
    """argv prefix to start a service under ``faketime`` (put it before ``python -m ...``).
    Note: the ``faketime`` binary forks the service as its child, so a :class:`Proc` holds the
    wrapper's PID; prefer :func:`faketime_env` for services stopped or signalled by PID.
    ``faketime`` fakes time(), gettimeofday and clock_gettime — also CLOCK_MONOTONIC, so a
    rate drift shows in the service's monotonic timers too."""
    exe = shutil.which("faketime")
    if exe is None:
        raise FileNotFoundError("faketime is not installed (make setup installs it)")
    return [exe, "-f", faketime_spec(skew_s, rate)]


def faketime_env(skew_s: float = 0.0, rate: float | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The same as environment variables (LD_PRELOAD + FAKETIME), for a :class:`Proc` whose
    argv must stay unchanged."""
    lib = next((p for p in FAKETIME_LIBS if os.path.exists(p)), None)
    if lib is None:
        raise FileNotFoundError("libfaketime not found (make setup installs faketime)")
    env = dict(os.environ if base is None else base)
    env.update({"LD_PRELOAD": lib, "FAKETIME": faketime_spec(skew_s, rate), "FAKETIME_NO_CACHE": "1",
                "DONT_FAKE_MONOTONIC": "0"})
    return env


# ----------------------------------------------------------------------------- schedule
@dataclass
class Step:
    at_s: float  # offset from the schedule's start
    nemesis: Nemesis
    duration_s: float  # 0 = start and stop immediately (an instantaneous fault)
    group: str | None = None  # steps of one group are moved together by the run's seeded jitter


@dataclass
class Schedule:
    """Run nemeses at offsets within ``duration_s``. Every fault is stopped by its own
    ``at + duration`` or, at the latest, when the schedule ends, is cancelled or fails."""

    duration_s: float
    steps: Sequence[Step] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not (0 < self.duration_s <= MAX_SCHEDULE_S):
            raise BadRequest(f"schedule duration must be in (0, {MAX_SCHEDULE_S}] s")
        if len(self.steps) > MAX_STEPS:
            raise BadRequest(f"at most {MAX_STEPS} steps")
        for s in self.steps:
            if s.at_s < 0 or s.duration_s < 0 or s.at_s > self.duration_s:
                raise BadRequest(f"step {s.nemesis!r}: offset and duration must be >= 0 and start within the schedule")

    async def run(self) -> list[Fault]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        end = t0 + self.duration_s

        async def one(step: Step) -> None:
            await asyncio.sleep(max(0.0, t0 + step.at_s - loop.time()))
            await step.nemesis.start()
            try:
                await asyncio.sleep(max(0.0, min(end, t0 + step.at_s + step.duration_s) - loop.time()))
            finally:
                await asyncio.shield(step.nemesis.stop())

        tasks = [asyncio.create_task(one(s)) for s in self.steps]
        try:
            if tasks:
                await asyncio.wait_for(asyncio.gather(*tasks), self.duration_s + 60.0)
            await asyncio.sleep(max(0.0, end - loop.time()))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for s in self.steps:  # belt and braces: nothing stays broken
                with contextlib.suppress(Exception):
                    await s.nemesis.stop()
        return [r for s in self.steps for r in s.nemesis.records]
