"""A chaos run's history: one JSON-lines file per run, one typed record per line.

Records are msgspec Structs in a tagged union (field ``type``). Times named ``*AtMs`` on a
record are on the clock of the process that wrote the history (the chaos runner), except
``expiresAtMs`` / ``issuedAtMs`` / ``windowStartMs`` / ``windowEndMs`` which are copied from
the allocator's answer (allocator clock). ``to_*`` helpers turn records into the plain
records of :mod:`chaos.invariants`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO

import msgspec
from msgspec import Struct

from chaos.invariants import (
    GrantSighting,
    LeaderTerm,
    PoolAdmission,
    PoolPolicy,
    SpendRecord,
    WindowStateRecord,
)
from kernel.wire import LeaseGrant


def now_ms() -> int:
    """The recorder clock: this process's wall clock in ms."""
    return time.time_ns() // 1_000_000


class _Rec(Struct, rename="camel", tag_field="type", kw_only=True):
    pass


class Grant(_Rec, tag="grant"):
    """A lease grant as a region's lease manager received it, or as the allocator answered."""

    lease_id: str
    pool: str
    region: str
    granted: int
    window_index: int
    expires_at_ms: int  # allocator clock
    ttl_ms: int
    epoch: int
    window_start_ms: int | None = None  # allocator clock
    window_end_ms: int | None = None  # allocator clock
    starts_in_ms: int = 0
    issued_at_ms: int | None = None  # allocator clock
    sent_at_ms: int | None = None  # recorder clock
    received_at_ms: int | None = None  # recorder clock
    source: str = "region"  # region | allocator | replay
    replayed: bool = False
    accepted: bool = True  # False: the region refused it (stale epoch)


class PoolSpend(Struct, rename="camel"):
    pool: str
    tokens: int = 1
    lease_id: str | None = None  # None: not spent from a lease (fallback / local allowance)
    window_index: int | None = None
    rule: str | None = None  # the rule that spends the pool: a denial by another rule never reached it


class DecisionRec(_Rec, tag="decision"):
    agent: str
    region: str
    tenant: str
    allowed: bool
    recorded_at_ms: int  # recorder clock (when the load generator got the answer)
    sent_at_ms: int | None = None  # recorder clock (when the gateway sent the request)
    spends: list[PoolSpend] = []
    fallback: bool = False
    local: bool = False  # admitted from a local allowance while the agent's Redis was unreachable
    reason: str | None = None
    route_group: str | None = None
    request_id: str | None = None
    rule_id: str | None = msgspec.field(default=None, name="policyId")  # the answer's rule, limit and remaining (which allowance answered)
    limit: int | None = None
    remaining: int | None = None
    gateway: str | None = None  # who decided, when not the agent: e.g. an Envoy from its RLQS assignment


class SpendClose(_Rec, tag="spend_close"):
    lease_id: str
    pool: str
    region: str
    granted: int
    spent: int
    closed_at_ms: int | None = None  # recorder clock


class Fault(_Rec, tag="fault"):
    """A fault and what it made unreachable (the bound's fault terms, see :mod:`kernel.bound`):
    ``allocatorRegions`` could not reach the allocator, ``redisAgents`` could not reach their
    Redis, ``restartedAgents`` were restarted (new processes, fresh in-process allowances) at
    ``stopMs``. ``graceMs``: how long after the fault stopped its effect may last (agents notice
    recovery on their next successful call)."""

    nemesis: str
    target: str
    start_ms: int  # recorder clock
    stop_ms: int | None = None  # recorder clock; None = still active when the run ended
    detail: str = ""
    allocator_regions: list[str] = []
    redis_agents: list[str] = []
    restarted_agents: list[str] = []
    grace_ms: int = 0
    envoys_cut_off: list[str] = []  # Envoys holding RLQS assignments that could not reach their agent


class EtcdGrant(_Rec, tag="etcd_grant"):
    """A grant record read back from etcd after the run."""

    lease_id: str
    pool: str
    region: str
    granted: int
    window_index: int
    epoch: int
    expires_at_ms: int | None = None  # allocator clock
    mod_revision: int | None = None
    create_revision: int | None = None
    spent: int | None = None  # from the lease's usage report, when one was accepted
    returned: int = 0  # tokens the report gave back to the pool


class EtcdWindow(_Rec, tag="etcd_window"):
    """A pool window's state read back from etcd after the run."""

    pool: str
    window_index: int
    limit: int
    remaining: int
    granted: int
    returned: int = 0
    mod_revision: int | None = None


class Leader(_Rec, tag="leader"):
    epoch: int
    node: str | None
    observed_at_ms: int  # recorder clock
    shard: int = 0  # the shard of allocator leadership (0: unsharded)


class Policy(_Rec, tag="policy"):
    """Pools in force from ``appliedAtMs`` (recorder clock) — e.g. a rollback published mid-run."""

    version: int
    applied_at_ms: int | None
    pools: list[PoolPolicy] = []


class Meta(_Rec, tag="meta"):
    scenario: str
    seed: int
    started_at_ms: int
    duration_s: float | None = None
    note: str = ""
    shards: int = 1  # shards of allocator leadership in the run (epochs are compared per shard)


class TopologyRec(_Rec, tag="topology"):
    """The run's topology: the agents of each region, and the clock offsets (ms, service clock -
    recorder clock) services were started with (libfaketime). Pool windows are defined by the
    allocator's clock, so the checker windows decisions with ``allocatorOffsetsMs``."""

    agents: dict[str, list[str]]  # region -> agent names
    allocator_offsets_ms: dict[str, int] = {}
    redis_offsets_ms: dict[str, int] = {}


class RlqsRec(_Rec, tag="rlqs"):
    """Envoys enforcing RLQS quota assignments in the run (the bound's RLQS term, kernel.bound):
    the Envoys of each region, per pool how many buckets each Envoy spends it from, an
    assignment's most tokens (the agents' ``--rlqs-max-assignment``), what an Envoy cut off from
    its agent admits per bucket and window (``kernel.bound.envoy_fallback_tokens`` of its bucket
    settings; None: unbounded) and the agents' clock margin."""

    envoys: dict[str, list[str]]  # region -> Envoy names
    buckets: dict[str, int]  # pool -> buckets per Envoy that spend it
    max_assignment: int
    fallback: int | None = 0
    margin_ms: int = 250


class Counters(_Rec, tag="counters"):
    """A sample of one service's own counters (``/metrics``), to explain decisions afterwards: e.g.
    which degradation (reason, fail mode) an agent counted in the second a fallback was admitted."""

    service: str
    at_ms: int  # recorder clock
    values: dict[str, float] = {}


Record = (Grant | DecisionRec | SpendClose | Fault | EtcdGrant | EtcdWindow | Leader | Policy | Meta
          | TopologyRec | Counters | RlqsRec)

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Record)


class HistoryWriter:
    """Append-only JSON-lines writer; thread-safe, flushed per record so a killed run keeps
    everything written so far."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f: IO[bytes] | None = open(self.path, "ab")
        self._lock = threading.Lock()
        self.count = 0

    def write(self, rec: Record) -> None:
        line = _encoder.encode(rec) + b"\n"
        with self._lock:
            if self._f is None:
                raise ValueError(f"history {self.path} is closed")
            self._f.write(line)
            self._f.flush()
            self.count += 1

    def write_all(self, recs: Iterable[Record]) -> None:
        for r in recs:
            self.write(r)

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None

    def __enter__(self) -> HistoryWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HistoryError(ValueError):
    pass


def read_history(path: str | Path) -> Iterator[Record]:
    """Yield every record; a malformed line raises :class:`HistoryError` naming the line, except
    a truncated last line (a run killed mid-write: the start of a record, ``{`` without its
    closing ``}``), which is ignored. A file with no record at all is not a history (an error)."""
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    last = max((i for i, raw in enumerate(lines) if raw.strip()), default=-1)
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            yield _decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            if i == last and i > 0 and raw.lstrip().startswith(b"{") and not raw.endswith(b"}"):
                return
            raise HistoryError(f"{path}:{i + 1}: {e}") from None
    if last < 0:
        raise HistoryError(f"{path}: holds no record (an empty file is not a chaos history)")


# ----------------------------------------------------------------------------- helpers
def grant_from_wire(g: LeaseGrant, *, sent_at_ms: int | None, received_at_ms: int | None,
                    source: str = "region", accepted: bool = True) -> Grant:
    return Grant(lease_id=g.lease_id, pool=g.pool, region=g.region, granted=g.granted,
                 window_index=g.window.index, window_start_ms=g.window.start_ms, window_end_ms=g.window.end_ms,
                 expires_at_ms=g.expires_at_ms, ttl_ms=g.ttl_ms, epoch=g.epoch, starts_in_ms=g.starts_in_ms,
                 issued_at_ms=g.issued_at_ms, sent_at_ms=sent_at_ms, received_at_ms=received_at_ms,
                 source=source, replayed=g.replayed, accepted=accepted)


def to_grant_sighting(g: Grant | EtcdGrant) -> GrantSighting:
    if isinstance(g, EtcdGrant):
        return GrantSighting(lease_id=g.lease_id, pool=g.pool, region=g.region, granted=g.granted,
                           window_index=g.window_index, epoch=g.epoch, expires_at_ms=g.expires_at_ms,
                           commit_revision=g.mod_revision, returned=g.returned)
    return GrantSighting(lease_id=g.lease_id, pool=g.pool, region=g.region, granted=g.granted,
                       window_index=g.window_index, epoch=g.epoch, expires_at_ms=g.expires_at_ms,
                       ttl_ms=g.ttl_ms, window_end_ms=g.window_end_ms, starts_in_ms=g.starts_in_ms,
                       sent_at_ms=g.sent_at_ms, received_at_ms=g.received_at_ms, accepted=g.accepted)


def to_pool_admissions(d: DecisionRec, window_of: dict[str, int] | None = None,
                        window_ms: Mapping[str, int] | None = None,
                        offsets_ms: tuple[int, int] = (0, 0)) -> list[PoolAdmission]:
    """One record per pool the decision touched, with the pool windows it may have been admitted
    in. A spend on a named lease is in its lease's window (``window_index``, else ``window_of``
    lease id -> index). Any other spend was admitted between the request's send and its answer:
    its candidates are the allocator-clock windows of that interval (``offsets_ms``: the least
    and greatest allocator clock - recorder clock), given the pool's ``window_ms``; without it
    the spend's own ``window_index`` stands. A spend with no window at all is dropped — writers
    always fill one in."""
    out: list[PoolAdmission] = []
    single = len(d.spends) == 1
    for s in d.spends:
        index = s.window_index
        if index is None and s.lease_id is not None and window_of:
            index = window_of.get(s.lease_id)
        last = None
        w = (window_ms or {}).get(s.pool)
        if s.lease_id is None and w:
            sent = d.sent_at_ms if d.sent_at_ms is not None else (index * w if index is not None else d.recorded_at_ms)
            index, last = (sent + offsets_ms[0]) // w, (max(sent, d.recorded_at_ms) + offsets_ms[1]) // w
        if index is None:
            continue
        out.append(PoolAdmission(pool=s.pool, window_index=index, region=d.region, allowed=d.allowed,
                                  tokens=s.tokens, fallback=(d.fallback or d.local) and s.lease_id is None,
                                  local=d.local and s.lease_id is None, lease_id=s.lease_id,
                                  at_ms=d.recorded_at_ms, agent=d.agent,
                                  last_window=last if last is not None and last != index else None,
                                  certain_source=single,
                                  offered=d.allowed or s.rule is None or d.rule_id == s.rule))
    return out


def to_spend_records(d: DecisionRec) -> list[SpendRecord]:
    """Lease spends of an allowed decision (timed on the recorder clock)."""
    if not d.allowed:
        return []
    return [SpendRecord(lease_id=s.lease_id, tokens=s.tokens, at_ms=d.recorded_at_ms, pool=s.pool, region=d.region)
            for s in d.spends if s.lease_id is not None]


def close_to_spend(c: SpendClose) -> SpendRecord:
    """A lease's closing report as an untimed spend (its ``spent`` total)."""
    return SpendRecord(lease_id=c.lease_id, tokens=c.spent, pool=c.pool, region=c.region)


def to_window_state(w: EtcdWindow) -> WindowStateRecord:
    return WindowStateRecord(pool=w.pool, window_index=w.window_index, limit=w.limit, remaining=w.remaining,
                             granted=w.granted, returned=w.returned)


def to_leader_term(rec: Leader) -> LeaderTerm:
    return LeaderTerm(epoch=rec.epoch, elected_revision=rec.epoch, elected_at_ms=rec.observed_at_ms, node=rec.node,
                      shard=rec.shard)


def policies_from(recs: Iterable[Record]) -> list[PoolPolicy]:
    """Pool versions from ``policy`` records, each stamped with the time it was applied."""
    out: list[PoolPolicy] = []
    for r in recs:
        if isinstance(r, Policy):
            for p in r.pools:
                out.append(msgspec.structs.replace(p, valid_from_ms=r.applied_at_ms))
    return out


class LeaseRecorder:
    """Implements the region agent's lease ``LeaseEvents`` hook
    (``region_agent.leasing.manager.LeaseEvents``): writes a ``grant`` record for every grant the
    agent accepted and a ``spend_close`` record for every lease it closed.

    The agent passes monotonic milliseconds; they are converted to this process's wall clock
    with one offset taken at construction. In an agent under ``faketime`` both clocks are
    faked, so these times are on the *agent's* (skewed) clock: only the history's own writer
    (the runner) is the recorder clock, and timing checks should not mix the two."""

    def __init__(self, writer: HistoryWriter, *, mono_ms: float | None = None, wall_ms: int | None = None):
        self.writer = writer
        mono = time.monotonic() * 1000.0 if mono_ms is None else mono_ms
        wall = now_ms() if wall_ms is None else wall_ms
        self._offset = wall - mono

    def _wall(self, mono_ms: float) -> int:
        return int(mono_ms + self._offset)

    def grant(self, *, region: str, pool: str, key_tag: str, lease: object | None, grant: object,
              sent_at: float, received_at: float) -> None:
        if not isinstance(grant, LeaseGrant):
            return
        self.writer.write(grant_from_wire(grant, sent_at_ms=self._wall(sent_at), received_at_ms=self._wall(received_at),
                                          source="region"))  # the agent calls this only for epoch-accepted grants

    def closed(self, *, region: str, pool: str, lease_id: str, granted: int, spent: int) -> None:
        self.writer.write(SpendClose(lease_id=lease_id, pool=pool, region=region, granted=granted, spent=spent,
                                     closed_at_ms=now_ms()))
