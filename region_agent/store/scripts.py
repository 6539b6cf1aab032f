"""The Redis Lua scripts as the agent calls them: the registry (:class:`Scripts`), its pipelines,
typed wrappers and error translation. The scripts' text comes from region_agent.store.lua_loader,
the RESP bytes from region_agent.store.resp, and every private part of redis-py it needs is in
region_agent.store.redis_internals.

Calls use EVALSHA; a NOSCRIPT reply means the script did not run, so it is
loaded and the call retried once; when that reload fails on its connection, the call still did
not run (:class:`~kernel.errors.NothingRan`, never ambiguous). Driver errors become
``kernel.errors`` types in :func:`translate_redis_error` (and :func:`not_run`) only.
"""

from __future__ import annotations

import os
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis import exceptions as rex
from redis.asyncio import RedisCluster
from redis.asyncio.sentinel import MasterNotFoundError
from redis.crc import key_slot

from kernel.algorithms import KINDS
from kernel.algorithms.pool import PoolEntry
from kernel.errors import (
    AmbiguousOutcome,
    LeaseholdError,
    NothingRan,
    ScriptRejected,
    StoreUnavailable,
)

from . import redis_internals as ri
from .lua_loader import DEFAULT_LUA_DIR, has_kinds, load_scripts, load_variant, parse_variant, variant_name
from .resp import ASKING, pack_evalsha, pack_pipeline

__all__ = ["KeysNotColocated", "PoolClosed", "PoolEntry", "Scripts", "SlotMigrating", "SlotMoved", "SlotRedirect",
           "StoreRefused", "not_run", "translate_redis_error"]

# Server error prefixes meaning "the command was refused before it ran": nothing happened. (redis-py
# strips the prefix of the replies it has an exception class for — OOM, NOPERM, READONLY ... — so
# those are told apart by class in translate_redis_error, never by this text.)
_NOT_RUN_PREFIXES = ("BUSY", "LOADING", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "READONLY", "NOREPLICAS",
                     "MOVED", "ASK", "OOM")


# how Redis 6 and 7.0 answer a script whose redis.call() names a command the caller's ACL user lacks
# (later versions answer NOPERM)
_SCRIPT_ACL_DENIAL = "The user executing the script can't run this command"

# the key of the start's access check (Scripts.check_access): in the agent's namespace
# (region_agent.decision.keys.NS), read only, never written
ACCESS_CHECK_KEY = "rl:v3:{access-check}:pool:none"


class StoreRefused(StoreUnavailable):
    """A reachable Redis refused to run the command because of how it is set up, not because of
    the call: ``cause`` ``oom`` (used memory above ``maxmemory`` under ``noeviction``: every write
    is refused), ``acl`` (the agent's ACL user may not run a command its scripts need, or touch
    their keys), ``auth`` (the credentials are wrong) or ``tls`` (its certificate does not verify
    against the CA the agent was given: no connection is made, so nothing is sent). Nothing ran. Like any store failure it
    counts against the node's breaker and the decision degrades per its rules' fail modes; it
    lasts until an operator acts, so the node names the cause in its log line."""

    code, title = "store-refused", "The store refused the agent's command"

    CAUSES = {"oom": "OOM: used memory above maxmemory", "acl": "NOPERM: the ACL user lacks a command or key",
              "auth": "the Redis credentials were refused",
              "tls": "TLS: the server's certificate did not verify"}

    def __init__(self, cause: str):
        super().__init__(f"store refused the command ({self.CAUSES[cause]})", extra={"cause": cause})
        self.cause = cause


class KeysNotColocated(ScriptRejected):
    """The keys of one script call span several hash slots (CROSSSLOT): a caller bug."""

    code, title = "keys-not-colocated", "Script keys span several hash slots"


class SlotRedirect(StoreUnavailable):
    """A healthy Redis Cluster primary did not run the call because of where its slot is: not a
    failure of that node (its breaker does not count it)."""

    code, title = "slot-redirect", "The key's slot is served elsewhere or being migrated"


class SlotMoved(SlotRedirect):
    """The primary answered ``MOVED`` (the slot has another owner now) or ``ASK`` (the slot is
    being migrated and this call's keys are all on the target already): the script did not run.
    The cluster store follows it (region_agent.store.cluster). ``host:port`` is where to go (an
    empty host: the host of the node that answered)."""

    code, title = "slot-moved", "The key's slot is served by another node"

    def __init__(self, slot: int, host: str, port: int, *, ask: bool = False):
        super().__init__(f"slot {slot} {'is migrating to' if ask else 'moved to'} another node")
        self.slot, self.host, self.port, self.ask = slot, host, port, ask


class SlotMigrating(SlotRedirect):
    """``TRYAGAIN``: the slot is being migrated and this call's keys are split between the two
    nodes (a multi-key script whose keys do not all exist on one side): nothing ran. It lasts
    until the migration of the slot ends; the decision degrades per its rules' fail modes."""

    code, title = "slot-migrating", "The key's slot is being migrated"


# --- error translation -------------------------------------------------------------------------
def _sent_heuristic(exc: BaseException) -> bool:
    """Whether a connection-level failure happened after the command was written.

    redis-py raises ``ConnectionError("Error ... connecting to ...")`` when it could not connect,
    before anything is sent; every other connection error or timeout happens on an established
    connection and may have reached the server."""
    text = str(exc)
    return not ("connecting to" in text or "Connection refused" in text or "Name or service" in text)


def translate_redis_error(exc: BaseException, sent: bool) -> LeaseholdError:
    """Driver error -> contract error. ``sent``: the command may have reached the server.

    Error replies from a script (validation) -> :class:`ScriptRejected` (not retriable);
    CROSSSLOT / client-side slot refusal -> :class:`KeysNotColocated`; MOVED / ASK ->
    :class:`SlotMoved` (the cluster store follows it), TRYAGAIN -> :class:`SlotMigrating`; OOM, NOPERM
    and refused credentials -> :class:`StoreRefused`; replies that mean the
    server refused to run anything (BUSY, LOADING, CLUSTERDOWN, NOSCRIPT ...) ->
    :class:`StoreUnavailable`; connection failures before send -> :class:`StoreUnavailable`;
    timeouts/resets after send -> :class:`AmbiguousOutcome`. Details never echo driver text.
    (A call stopped before it was written, by its connection's handshake or by the reload after a
    NOSCRIPT: :func:`not_run`.)"""
    if isinstance(exc, LeaseholdError):
        return exc
    if isinstance(exc, rex.NoScriptError):
        return StoreUnavailable("script not loaded on the store")
    if isinstance(exc, MasterNotFoundError):  # asked before connecting: nothing was sent
        return StoreUnavailable("no primary known to the Redis sentinels")
    if isinstance(exc, rex.AskError):  # MovedError is an AskError: nothing ran, another node owns the slot
        return SlotMoved(exc.slot_id, exc.host, exc.port, ask=not isinstance(exc, rex.MovedError))
    if isinstance(exc, rex.TryAgainError):
        return SlotMigrating("the key's slot is being migrated (TRYAGAIN)")
    if isinstance(exc, rex.OutOfMemoryError):
        return StoreRefused("oom")
    if isinstance(exc, rex.NoPermissionError):
        return StoreRefused("acl")
    if isinstance(exc, rex.AuthenticationError):  # (a ConnectionError: before that branch)
        return StoreRefused("auth")
    if isinstance(exc, rex.ConnectionError):
        if isinstance(exc.__cause__ or exc.__context__, ssl.SSLCertVerificationError):
            return StoreRefused("tls")  # (redis-py raises it while handling the ssl error: its __context__)
        if isinstance(exc.__cause__, (rex.NoPermissionError, rex.AuthenticationError)):
            # redis-py's unix-socket connection wraps its handshake's refusal (AUTH, SELECT) in a ConnectionError
            return translate_redis_error(exc.__cause__, sent=False)
    if isinstance(exc, rex.ClusterCrossSlotError):
        return KeysNotColocated("script keys are not in one hash slot")
    if isinstance(exc, (rex.ClusterDownError, rex.MasterDownError, rex.BusyLoadingError,
                        rex.ReadOnlyError, rex.SlotNotCoveredError, rex.MaxConnectionsError)):
        # refused or never sent: nothing ran
        return StoreUnavailable(f"store unavailable ({type(exc).__name__})")
    if isinstance(exc, rex.ResponseError):
        text = str(exc)
        if text.startswith("CROSSSLOT"):
            return KeysNotColocated("script keys are not in one hash slot")
        if text.startswith(_NOT_RUN_PREFIXES):
            return StoreUnavailable(f"store refused the command ({text.split(' ', 1)[0]})")
        if _SCRIPT_ACL_DENIAL in text:  # a script's call the ACL denies (Redis 6 and 7.0 say so in an ERR)
            return StoreRefused("acl")
        return ScriptRejected("limiter script rejected its arguments")
    if isinstance(exc, rex.RedisClusterException) and "same key slot" in str(exc).lower():
        return KeysNotColocated("script keys are not in one hash slot")
    if isinstance(exc, (rex.TimeoutError, TimeoutError)):
        if sent:
            return AmbiguousOutcome("no reply from the store before the timeout", extra={"cause": "timeout"})
        return StoreUnavailable("timed out connecting to the store", extra={"cause": "timeout"})
    if isinstance(exc, (rex.ConnectionError, ConnectionError, OSError)):
        if sent:
            return AmbiguousOutcome("connection lost after the command was sent")
        return StoreUnavailable("store unreachable")
    if isinstance(exc, rex.RedisError):
        return StoreUnavailable(f"store error ({type(exc).__name__})")
    return StoreUnavailable(f"unexpected store failure ({type(exc).__name__})")


def _translate(exc: BaseException) -> LeaseholdError:
    return translate_redis_error(exc, sent=_sent_heuristic(exc))


def not_run(exc: BaseException) -> LeaseholdError:
    """What a script call is when ``exc`` stopped it before any byte of it was written — a new
    connection that failed its handshake, or the reload of a call answered ``NOSCRIPT`` (which
    did not run) before the call was sent again: the driver's error as
    :func:`translate_redis_error` reads it, except that a connection lost or timed out *after*
    something was sent on it — the handshake's ``HELLO``, the ``SCRIPT LOAD``, neither of which
    changes limiter state — is :class:`~kernel.errors.NothingRan` for the call (sent again,
    never ambiguous). A store that could not be connected to, or refused, stays what it is."""
    err = _translate(exc)
    if isinstance(err, AmbiguousOutcome):
        return NothingRan("the call was not written: its connection failed before it", extra=err.extra)
    return err


# --- typed results -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PoolDepositResult:
    stored: bool  # True for "stored" and "replay"
    status: str  # "stored" | "replay" | "full" | "expired"
    entries: int  # fields in the hash before this deposit


@dataclass(frozen=True, slots=True)
class PoolBalance:
    now_ms: int
    entries: dict[str, PoolEntry]
    incarnation: str = ""  # the node's current one: entries of another are never spendable

    def spendable(self) -> int:
        return sum(e.granted - e.spent for e in self.entries.values()
                   if e.valid_at(self.now_ms, self.incarnation) and e.granted > e.spent)


@dataclass(frozen=True, slots=True)
class PoolClosed:
    """What ``pool_close`` removed: ``current`` False = the entry was restored from an older
    incarnation of the node (its spent count may miss debits)."""

    granted: int
    spent: int
    current: bool


def has_error(replies: Sequence[Any]) -> bool:
    """Whether any reply is an exception instance (an error reply, or an error in its place)."""
    for r in replies:
        if isinstance(r, BaseException):
            return True
    return False


def _connection_lost(e: BaseException) -> bool:
    """A connection-level failure (reset, closed by the server) — not a timeout."""
    return isinstance(e, (rex.ConnectionError, ConnectionError, OSError)) and not isinstance(e, (TimeoutError,
                                                                                               rex.TimeoutError))


def _demoted(replies: list[Any]) -> bool:
    """A reply says READONLY: this connection reaches a replica — the primary it was opened to
    was demoted (a failover behind a DNS name, as managed Redis services do it, or a REPLICAOF).
    Its connections must go: a new one resolves the name again and finds the promoted primary,
    while kept ones would be answered READONLY for as long as they live. (The pipeline's own
    connection is back in the pool by then, idle, so it goes too; a Sentinel-managed client's
    connections already drop themselves on READONLY.)"""
    for r in replies:
        if r.__class__ is rex.ReadOnlyError:
            return True
    return False


async def _drop_idle(client: Any, held: ri.HeldConnections | None = None) -> None:
    """One pooled connection was lost: the idle ones most likely were too (the server restarted or
    failed over), so close them now instead of failing one decision on each of them later —
    those the node's pipelines hold (``held``) as well as the pool's."""
    if isinstance(client, RedisCluster):
        return  # the cluster client rebuilds its node connections itself
    try:
        if held is not None:
            await held.drop()
        await client.connection_pool.disconnect(inuse_connections=False)
    except Exception:  # closing dead sockets: nothing to report
        pass


def _b(x: Any) -> bytes:
    return x if isinstance(x, bytes) else str(x).encode()


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


# --- registry ----------------------------------------------------------------------------------
class Scripts:
    """Every script of ``lua/``, loaded once, called by SHA with one NOSCRIPT reload.

    ``lua_dir`` defaults to ``$LEASEHOLD_LUA_DIR`` or the scripts shipped in the package
    (``region_agent/lua``, a symlink to the repository's ``lua/`` that a wheel carries as files).

    A script that dispatches on call kinds also answers to its lean variants' names
    (``multi_rule[tb]``, region_agent.store.lua_loader): those of one kind are registered (and
    loaded by :meth:`load_all`) from the start, any other the first time it is named; a variant
    new to a node is loaded there by the NOSCRIPT reload, like any script after a restart."""

    def __init__(self, lua_dir: Path | None = None):
        env = os.environ.get("LEASEHOLD_LUA_DIR")
        self.lua_dir = (lua_dir or (Path(env) if env else DEFAULT_LUA_DIR)).resolve()
        self.scripts = load_scripts(self.lua_dir)
        if not self.scripts:
            raise FileNotFoundError(f"no Lua scripts in {self.lua_dir}")
        self._shas = {name: script.sha for name, script in self.scripts.items()}
        self._dispatching = frozenset(n for n in self.scripts if has_kinds(self.lua_dir, n))  # read once
        for name in self._dispatching:
            for code in KINDS:
                self._add_variant(variant_name(name, [code]))

    def _add_variant(self, name: str) -> bool:
        """Register the lean variant ``name`` if it is one (a finite set: subsets of the
        registered kinds of the scripts with a ``-- @kinds`` line); any other name costs a
        regular expression, no file read."""
        parsed = parse_variant(name)
        if parsed is None or parsed[0] not in self._dispatching:
            return False
        variant = self.scripts[name] = load_variant(self.lua_dir, *parsed)
        self._shas[name] = variant.sha
        return True

    def sha(self, name: str) -> str:
        try:
            return self.scripts[name].sha
        except KeyError:
            if self._add_variant(name):
                return self.scripts[name].sha
            raise ScriptRejected(f"no script named {name!r}") from None

    def source(self, name: str) -> str:
        return self.scripts[name].source

    async def load_all(self, client: Any) -> None:
        """SCRIPT LOAD every script (a RedisCluster client sends it to all primaries)."""
        try:
            for s in list(self.scripts.values()):  # a variant may be registered meanwhile
                got = await client.script_load(s.source)
                if _s(got) != s.sha:
                    raise ScriptRejected(f"store computed another SHA for {s.name}")
        except LeaseholdError:
            raise
        except Exception as e:
            raise _translate(e) from None

    async def check_access(self, client: Any) -> None:
        """One read-only script call (``pool_balance`` of :data:`ACCESS_CHECK_KEY`, a key no pool
        has): EVALSHA, the Redis TIME and INFO the scripts read, and a key of the agent's
        namespace, under the agent's credentials and ACL user. Raises what the call raised
        (:class:`StoreRefused` for credentials or a permission the ACL lacks); SCRIPT LOAD alone
        does not tell that the scripts may run. ``client`` as for :meth:`call`."""
        await self.call(client, "pool_balance", [ACCESS_CHECK_KEY], [])

    async def _load_one(self, client: Any, name: str) -> None:
        await client.script_load(self.scripts[name].source)

    async def call(self, client: Any, name: str, keys: Sequence[str], argv: Sequence[Any]) -> Any:
        """EVALSHA ``name``: a pipeline of one call (:meth:`run_pipeline`, whose NOSCRIPT reload
        and re-run it shares). Raises contract errors only. ``client`` may also be a router that
        sends a call to the node owning its keys (``call_script``: a Redis Cluster,
        region_agent.store.cluster)."""
        route = getattr(client, "call_script", None)
        if route is not None:
            reply = await route(self, name, list(keys), list(argv))
            if isinstance(reply, BaseException):
                raise reply
            return reply
        (reply,) = await self.run_pipeline(client, [(name, list(keys), list(argv))])
        if isinstance(reply, BaseException):
            raise reply
        return reply

    async def run_pipeline(self, client: Any, calls: Sequence[tuple[str, list, list]],
                           reading: dict[int, Any] | None = None, held: ri.HeldConnections | None = None
                           ) -> list[object]:
        """One pipeline (transaction=False) of EVALSHA; per call the raw reply or the translated
        exception instance. Calls answered NOSCRIPT (they did not run) are re-run once after loading.
        ``reading``: while a standalone pipeline waits for its replies, its connection and the
        monotonic time it was sent are in there (see :func:`~region_agent.store.redis_internals.answer_waiting`).
        ``held``: the connections the caller's pipelines keep between pipelines (a store node's:
        :class:`~region_agent.store.redis_internals.HeldConnections`); None: a pool checkout each."""
        if not calls:
            return []
        try:
            results = await self._pipeline(client, calls, reading, held)
        except Exception as e:
            err = _translate(e)
            return [err for _ in calls]
        if not has_error(results):  # the common case: every call answered, nothing to translate
            return results
        if _demoted(results):  # these connections reach a replica now: new ones find the primary
            await _drop_idle(client, held)
        missing = [i for i, r in enumerate(results) if isinstance(r, rex.NoScriptError)]
        if missing:
            again: list[Any]
            try:
                for name in {calls[i][0] for i in missing}:
                    await self._load_one(client, name)
            except Exception as e:  # the calls were not sent again: none of them ran
                again = [not_run(e) for _ in missing]
            else:
                try:
                    again = await self._pipeline(client, [calls[i] for i in missing], reading, held)
                except Exception as e:
                    again = [e for _ in missing]
            for i, r in zip(missing, again, strict=True):
                results[i] = r
        return [(_translate(r) if isinstance(r, BaseException) else r) for r in results]

    async def _pipeline(self, client: Any, calls: Sequence[tuple[str, list, list]],
                        reading: dict[int, Any] | None = None, held: ri.HeldConnections | None = None) -> list[Any]:
        """Raw pipeline results. On a cluster, a call whose keys span slots is answered here with
        :class:`KeysNotColocated` and left out (redis-py would refuse the whole pipeline)."""
        cluster = isinstance(client, RedisCluster)
        if not cluster:
            shas = self._shas
            try:
                commands = [(shas[name], keys, argv) for name, keys, argv in calls]
            except KeyError:  # a script this agent does not have: answered per call below
                pass
            else:  # the common case: every script is known, all calls go in one raw pipeline
                return await self._raw_pipeline(client, commands, reading, held)
        results: list[Any] = [None] * len(calls)
        send: list[int] = []
        for i, (name, keys, _) in enumerate(calls):
            if name not in self.scripts and not self._add_variant(name):
                results[i] = ScriptRejected(f"no script named {name!r}")
            elif cluster and len({key_slot(_b(k)) for k in keys}) > 1:
                results[i] = KeysNotColocated("script keys are not in one hash slot")
            else:
                send.append(i)
        if not send:
            return results
        if cluster:
            pipe = client.pipeline(transaction=False)
            for i in send:
                name, keys, argv = calls[i]
                # execute_command: redis-py's cluster pipeline blocks the evalsha() helper
                pipe.execute_command("EVALSHA", self.sha(name), len(keys), *keys, *argv)
            replies = await pipe.execute(raise_on_error=False)
        else:
            replies = await self._raw_pipeline(client, [(self.sha(calls[i][0]), calls[i][1], calls[i][2]) for i in send],
                                               reading, held)
        for i, r in zip(send, replies, strict=True):
            results[i] = r
        return results

    async def _raw_pipeline(self, client: Any, commands: Sequence[tuple[str, list, list]],
                            reading: dict[int, Any] | None = None, held: ri.HeldConnections | None = None
                            ) -> list[Any]:
        """A standalone pipeline without redis-py's per-command packing and bookkeeping (a third of
        the agent's CPU per decision in profiles): the EVALSHA commands are packed here in RESP
        (:func:`pack_evalsha`), written once on a pooled connection and the replies read in
        order; error replies come back as exception instances, like ``raise_on_error=False``. A
        connection that failed mid-way is disconnected before it goes back to the pool.
        ``commands``: ``(sha, KEYS, ARGV)`` each."""
        return await self._exchange(client, pack_pipeline(commands), len(commands), reading, held)

    async def run_asking(self, client: Any, call: tuple[str, list, list]) -> Any:
        """One call sent right after ``ASKING`` on the same connection (a Redis Cluster slot being
        migrated: the node it is migrating to serves the key only so): the reply, or the translated
        error in its place. NOSCRIPT (the target never ran this script) loads it and sends once more."""
        name, keys, argv = call
        if name not in self.scripts:
            return ScriptRejected(f"no script named {name!r}")
        for attempt in (0, 1):
            try:
                _, reply = await self._exchange(client, ASKING + pack_evalsha(self.sha(name), keys, argv), 2)
            except Exception as e:
                return _translate(e)
            if isinstance(reply, rex.NoScriptError) and attempt == 0:
                try:
                    await self._load_one(client, name)
                except Exception as e:  # not sent again: it did not run
                    return not_run(e)
                continue
            return _translate(reply) if isinstance(reply, BaseException) else reply
        return StoreUnavailable("script not loaded on the store")  # not reached

    async def _exchange(self, client: Any, payload: bytes, n: int, reading: dict[int, Any] | None = None,
                        held: ri.HeldConnections | None = None) -> list[Any]:
        """Write ``payload`` on a pooled connection and read ``n`` replies (see :meth:`_raw_pipeline`).
        ``reading`` holds the connection while the store owes its answer — and, with no connection
        yet, the time a new connection's handshake started (a store that accepts connections and
        never answers, e.g. stopped, hangs there; a connected one is handed over at once).
        ``held``: a connection held since the caller's last pipeline is used when it is
        :func:`~region_agent.store.redis_internals.sendable`, and held again after a pipeline that
        read every reply; any other goes through the pool (its checkout reconnects or refuses it)."""
        pool = client.connection_pool
        conn = held.take() if held is not None else None
        if conn is not None and not ri.sendable(conn):
            await pool.release(conn)  # the pool's checkout below judges it (reconnect, "Connection has data")
            conn = None
        if conn is None:
            try:
                if reading is None:
                    conn = await pool.get_connection()
                else:
                    token = object()
                    reading[id(token)] = (None, time.monotonic())
                    try:
                        conn = await pool.get_connection()
                    finally:
                        reading.pop(id(token), None)
            except Exception as e:
                # no byte of this pipeline was written: a connect or a handshake that failed (a reset while
                # the new connection said HELLO included) is never ambiguous, whatever the driver's text
                raise not_run(e) from None
        done = False
        try:
            if not ri.write_now(conn, payload):
                await conn.send_packed_command(payload)
            if reading is not None:  # sent: from now on the store owes the answer
                reading[id(conn)] = (conn, time.monotonic())
            replies = await ri.read_replies(conn, n)
            done = True
            return replies
        except BaseException as e:
            await conn.disconnect()
            if _connection_lost(e):
                await _drop_idle(client, held)
            raise
        finally:
            if reading is not None:
                reading.pop(id(conn), None)
            if not (done and held is not None and held.keep(conn)):
                await pool.release(conn)

    # --- typed wrappers --------------------------------------------------------------------------
    async def pool_deposit(self, client: Any, key: str, lease_id: str, *, granted: int, valid_from_ms: int,
                           expires_at_ms: int, max_entries: int, slack_ms: int) -> PoolDepositResult:
        r = await self.call(client, "pool_deposit", [key],
                            [lease_id, granted, valid_from_ms, expires_at_ms, max_entries, slack_ms])
        return PoolDepositResult(bool(int(r[0])), _s(r[1]), int(r[2]))

    async def pool_close(self, client: Any, key: str, lease_id: str) -> PoolClosed | None:
        """The removed lease, or None if it was not there (already closed, never deposited, or
        lost with the node's data)."""
        r = await self.call(client, "pool_close", [key], [lease_id])
        granted, spent = int(r[0]), int(r[1])
        return None if granted < 0 else PoolClosed(granted, spent, bool(int(r[2])))

    async def pool_balance(self, client: Any, key: str) -> PoolBalance:
        r = await self.call(client, "pool_balance", [key], [])
        flat = [_s(x) for x in r[1]]
        entries: dict[str, PoolEntry] = {}
        for lease_id, value in zip(flat[0::2], flat[1::2], strict=True):
            e = PoolEntry.decode(value)
            if e is not None:
                entries[lease_id] = e
        return PoolBalance(int(r[0]), entries, _s(r[2]))
