"""The Redis scripts' own cost, A/B: Redis's time per EVALSHA (``INFO commandstats``) of the scripts
of this checkout's ``lua/`` against those of another source tree's (``--base``, e.g. a ``git
archive`` of ``main`` unpacked; ``--tree`` adds more, e.g. the commits of a change), all expanded
by this checkout's loader (region_agent.store.lua_loader), on one redis-server started here.

    python -m bench.lua_cost --base /tmp/main-src [--tree NAME=DIR ...] [--calls 10000] [--rounds 5]
        [--users 10000] [--only TEXT] [--cpu]

Per workload and round, each tree's script runs ``--calls`` times from a clean database (FLUSHALL,
CONFIG RESETSTAT), in pipelines of 100, the trees one after the other (in reverse order every
other round). Printed: the median over rounds of each tree's microseconds per call, and of each
other tree's differences to the first one's in the same round. The workloads are the calls the
agent sends, their KEYS and ARGV built by its own code (region_agent.decision.call): ``multi_rule``
for 1, 2, 3 and 5 rules of mixed kinds with and without a decision record, a hot key set's
``hot_chunk``; and the single-rule scripts, which run the same libraries. Users cycle over
``--users`` (the first pass writes new keys, later ones update them); 1,000 tenants. A call
answered by an error is refused (it measured nothing). Without ``--base`` only this checkout is
measured. ``--cpu``: the redis-server process's CPU per call (``INFO cpu``) instead, which a busy
machine inflates less (a script preempted mid-run counts its wait in commandstats' time, not in
its CPU); it includes the protocol and the sockets, the same for every tree."""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis

from kernel.algorithms import make_rule
from kernel.bundle import load_bundle_file
from leasehold.local.procs import LOOPBACK, RedisServer
from region_agent.decision.call import Call, multi_rule_argv, script_for
from region_agent.store.scripts import Scripts

from .harness import NORTHSTAR, redis_cpu, services

CHECKOUT = Path(__file__).resolve().parents[1]
PIPELINE = 100
SLACK, RECORD_TTL = 5_000, 30_000  # ttl_slack_ms as the bundles' default; decision_ttl_ms of a recorded decision
TENANTS = 1_000

Args = tuple[list[str], list[object]]  # (KEYS, ARGV) of one call


@dataclass(frozen=True)
class Workload:
    name: str
    script: str  # the script (or lean variant) the agent names
    call: Callable[[int, int], Args]  # (call number, user) -> KEYS, ARGV


def _key(user: int, what: str) -> str:
    """A key shaped like the agent's: the tenant's hash tag, a 16-hex hash, the route."""
    return f"rl:v3:{{t:t{user % TENANTS:04d}}}:{what}:{user:016x}:read"


Slot = tuple[str, str, tuple[int, ...]]  # (key kind, call kind, the five parameters for one unit)


def _slots() -> dict[str, Slot]:
    """Rule slots by name: Northstar's user and tenant buckets and a slot of every other kind a
    decision may charge (a concurrency gate's as plan.Shape builds it), with limits a user's few
    calls stay under."""
    northstar = {r.id: r for r in load_bundle_file(str(NORTHSTAR)).rules}
    rules = {
        "tb": ("u", northstar["read-user-v3"]),
        "tenant": ("tenant", northstar["tenant-atlas-minute"]),
        "fw": ("fw", make_rule(algorithm="fixed_window", id="fw", scope="user", fail_mode="open", limit=100,
                               window_ms=10_000)),
        "sc": ("sc", make_rule(algorithm="sliding_counter", id="sc", scope="user", fail_mode="open", limit=1_000,
                               window_ms=60_000)),
        "gcra": ("gcra", make_rule(algorithm="gcra", id="gcra", scope="user", fail_mode="open",
                                   capacity_millis=50_000, refill_millis=10_000, period_ms=1_000, cost_millis=1_000)),
        "sl": ("sl", make_rule(algorithm="sliding_log", id="sl", scope="user", fail_mode="open", limit=100,
                               window_ms=10_000)),
    }
    slots: dict[str, Slot] = {name: (what, r.kind.code, tuple(r.script_params(1))) for name, (what, r) in rules.items()}
    slots["cc"] = ("cc", "cc", (10, 30_000, 0, 0, 0))  # max_in_flight, lease_ttl_ms
    return slots


def _calls(chosen: list[Slot], user: int) -> list[Call]:
    return [Call(_key(user, what), kind, params) for what, kind, params in chosen]


def multi_rule(names: list[str], record: bool) -> Workload:
    """``multi_rule`` for the rule slots ``names`` (of :func:`_slots`), as the agent sends it."""
    slots = _slots()
    chosen = [slots[s] for s in names]

    def call(i: int, user: int) -> Args:
        keys, argv = multi_rule_argv(_key(i, "d"), _calls(chosen, user), slack_ms=SLACK,
                                     decision_ttl_ms=RECORD_TTL if record else 0, member=f"req-{i}",
                                     question=f"{user:016x}" if record else "")
        return list(keys), list(argv)

    name = f"multi_rule {len(names)} ({','.join(names)}){', record' if record else ''}"
    return Workload(name, script_for(tuple(kind for _, kind, _ in chosen)), call)


def hot_chunk() -> Workload:
    """A hot key set's chunk (region_agent.leasing.hot_chunks): the user and tenant buckets, 1..100 units."""
    slots = _slots()
    chosen = [slots["tb"], slots["tenant"]]

    def call(i: int, user: int) -> Args:
        calls = _calls(chosen, user)
        _, argv = multi_rule_argv(_key(i, "d"), calls, slack_ms=SLACK, decision_ttl_ms=0, member="-")
        return [c.key for c in calls], [SLACK, f"chunk-{i}", 1, 100, *argv[3:-1]]

    return Workload("hot_chunk 2 (tb,tenant)", script_for(("tb", "tb"), "hot_chunk"), call)


def single(script: str, argv: Callable[[int], list[object]]) -> Workload:
    return Workload(script, script, lambda i, user: ([_key(user, script)], argv(i)))


def workloads() -> list[Workload]:
    out = [multi_rule(s, rec) for s in (["tb"], ["tb", "tenant"], ["tb", "tenant", "fw"],
                                       ["tb", "tenant", "fw", "sc", "gcra"]) for rec in (False, True)]
    out += [multi_rule(["sl", "cc"], True), hot_chunk()]
    out += [single("token_bucket", lambda i: [20_000, 2_000, 1_000, 1_000, SLACK]),
            single("gcra", lambda i: [50_000, 10_000, 1_000, 1_000, SLACK]),
            single("fixed_window", lambda i: [100, 10_000, 1, SLACK]),
            single("sliding_counter", lambda i: [1_000, 60_000, 1, SLACK]),
            single("sliding_log", lambda i: [100, 10_000, f"m-{i}", 1, SLACK]),
            single("concurrency_acquire", lambda i: [f"L-{i}", 10, 30_000])]
    return out


def run(r: redis.Redis, sha: str, w: Workload, calls: int, users: int, cpu: bool = False) -> float:
    """Redis's microseconds per EVALSHA of ``calls`` calls of ``w`` from a clean database: its time
    inside the command (commandstats), or with ``cpu`` the redis-server process's CPU time (the
    script, the protocol and the sockets; time it waited for a core on a busy machine not counted)."""
    r.flushall()
    r.config_resetstat()
    cpu0 = redis_cpu(r)
    pipe = r.pipeline(transaction=False)
    for i in range(calls):
        keys, argv = w.call(i, i % users)
        pipe.evalsha(sha, len(keys), *keys, *argv)
        if i % PIPELINE == PIPELINE - 1 or i == calls - 1:
            for reply in pipe.execute(raise_on_error=False):
                if isinstance(reply, Exception):
                    raise RuntimeError(f"{w.name}: the script answered an error: {reply}")
    cpu1 = redis_cpu(r)
    st = r.info("commandstats")["cmdstat_evalsha"]
    if int(st["calls"]) != calls or int(st.get("failed_calls", 0)):
        raise RuntimeError(f"{w.name}: {st}")
    return 1e6 * (cpu1 - cpu0) / calls if cpu else int(st["usec"]) / int(st["calls"])


def measure(trees: dict[str, Path], work: list[Workload], *, calls: int, users: int, rounds: int,
            workdir: Path, cpu: bool = False) -> dict[str, dict[str, list[float]]]:
    """{workload: {tree: [us per call, one per round]}} on a redis-server started here (:func:`run`)."""
    scripts = {name: Scripts(tree / "lua") for name, tree in trees.items()}
    results: dict[str, dict[str, list[float]]] = {w.name: {t: [] for t in trees} for w in work}
    server = RedisServer(workdir).start()
    with services(server):
        r = redis.Redis(host=LOOPBACK, port=server.port)
        try:
            for rnd in range(rounds):
                order = list(trees) if rnd % 2 == 0 else list(reversed(trees))
                for w in work:
                    for t in order:
                        sha = r.script_load(_source(scripts[t], w.script))
                        results[w.name][t].append(run(r, sha, w, calls, users, cpu))
        finally:
            r.close()
    return results


def _source(s: Scripts, name: str) -> str:
    """The text of the script (or lean variant) ``name``: ``sha`` registers a variant of several
    kinds the first time it is named, as the agent's first call of it does."""
    s.sha(name)
    return s.source(name)


def table(results: dict[str, dict[str, list[float]]]) -> str:
    """Markdown: per workload, the first tree's median us per call, and each other tree's with the
    median of its rounds' differences to the first (each round's runs are back to back: a slow
    minute of a shared machine moves them all)."""
    trees = list(next(iter(results.values())))
    lines = ["| script | " + " | ".join(f"{t} us/call" for t in trees) + " |", "|---" * (len(trees) + 1) + "|"]
    for name, per_tree in results.items():
        first = per_tree[trees[0]]
        cells = [f"{statistics.median(first):.2f}"]
        for t in trees[1:]:
            diff = statistics.median(b - a for a, b in zip(first, per_tree[t], strict=True))
            cells.append(f"{statistics.median(per_tree[t]):.2f} ({diff:+.2f}, {100 * diff / statistics.median(first):+.0f} %)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(prog="python -m bench.lua_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, help="another source tree (its lua/ is measured as 'base')")
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="more trees measured between base and this (e.g. the commits of a change, one by one)")
    ap.add_argument("--calls", type=int, default=10_000, help="calls per workload, tree and round")
    ap.add_argument("--users", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", default="", help="workloads whose name contains this text")
    ap.add_argument("--cpu", action="store_true",
                    help="the redis-server process's CPU per call (INFO cpu) instead of commandstats' time")
    args = ap.parse_args(argv)
    trees = {"base": args.base.resolve()} if args.base else {}
    trees.update({t.split("=", 1)[0]: Path(t.split("=", 1)[1]).resolve() for t in args.tree})
    trees["this"] = CHECKOUT
    work = [w for w in workloads() if args.only in w.name]
    with tempfile.TemporaryDirectory(prefix="lua-cost-") as tmp:
        out = table(measure(trees, work, calls=args.calls, users=args.users, rounds=args.rounds, workdir=Path(tmp),
                            cpu=args.cpu))
    print(out)
    return out


if __name__ == "__main__":
    main()
